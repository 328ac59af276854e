"""Blank-image detection: the measures, the column job, stats, the export note and a skip list."""

from __future__ import annotations

import io
import json
import os

import lance
import numpy as np
import pytest
from PIL import Image
from prx_data.pipelines.quality import compute_quality

from prx_data.cli import quality as quality_cli
from prx_data.cli import skips as skips_cli
from prx_data.core import quality as Q
from prx_data.core.runtime import RunOptions
from prx_data.export.merge import finalize
from prx_data.export.prepare import plan_units, prepare_output
from prx_data.export.spec import ExportConfig
from prx_data.export.unit import export_unit
from prx_data.table import resolution
from tests.tablekit import make_table


def _png(im: Image.Image) -> bytes:
    buf = io.BytesIO()
    im.save(buf, "PNG")
    return buf.getvalue()


def _photo(seed: int, w: int = 640, h: int = 640) -> bytes:
    """Smooth gradients plus noise: real-looking variation, not a fill."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    base = np.stack([x / w * 200, y / h * 180, (x + y) / (w + h) * 220], axis=-1)
    px = np.clip(base + rng.normal(0, 10, (h, w, 3)), 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(px).save(buf, "JPEG", quality=90)
    return buf.getvalue()


def _overlay(w: int = 640, h: int = 640) -> bytes:
    """A wallpaper overlay: dark pixels, fully transparent; the export makes it pure white."""
    a = np.zeros((h, w, 4), np.uint8)
    a[..., :3] = 20
    return _png(Image.fromarray(a, "RGBA"))


def _logo_on_white(w: int = 640, h: int = 640) -> bytes:
    a = np.full((h, w, 3), 255, np.uint8)
    a[300:310, 300:310] = (200, 0, 0)  # 100 of 409,600 pixels
    return _png(Image.fromarray(a))


def test_measures_separate_blank_from_real_images():
    overlay = Q.measure(_overlay())
    assert overlay == Q.Quality(0.0, 0.0, 1.0) and overlay.low_information
    logo = Q.measure(_logo_on_white())
    assert logo.flat > 0.99 and logo.low_information  # a tiny std would not catch it alone
    photo = Q.measure(_photo(1))
    assert photo.std > 30 and photo.entropy > 5 and photo.flat < 0.05
    assert not photo.low_information
    # A red/blue split with equal grey levels is not blank: std is per channel.
    split = np.zeros((64, 64, 3), np.uint8)
    split[:, :32] = (255, 0, 0)
    split[:, 32:] = (0, 0, 255)
    assert Q.measure_rgb(split).std > 100
    with pytest.raises(Q.ImageError):
        Q.measure(b"not an image")
    with pytest.raises(ValueError):
        Q.measure_rgb(np.zeros((4, 4), np.uint8))
    arr = Q.measure_many([_overlay(8, 8), None, b"junk", _photo(2, 64, 64)])
    assert arr.to_pylist()[1:3] == [None, None] and arr.to_pylist()[0]["std"] == 0


@pytest.fixture()
def quality_table(tmp_path):
    uri = str(tmp_path / "t.lance")
    items = [(f"p/{i}", _photo(i), f"photo {i}") for i in range(4)]
    items += [("b/overlay", _overlay(), "an overlay"), ("b/logo", _logo_on_white(), "a logo")]
    items += [("x/broken", b"not an image", "broken")]
    make_table(uri, items, max_rows_per_file=3)
    return uri


def test_column_job_stats_and_cli(quality_table, tmp_path, capsys):
    assert quality_cli.main(["--table", quality_table, "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "measured 6 rows; 1 unreadable" in out and "2 low-information" in out
    assert Q.LOW_INFORMATION_SQL in out
    # Resumable: a second run measures nothing new (the unreadable row stays null and counted).
    assert compute_quality(
        quality_table,
        run=RunOptions(progress=False),
    ) == {
        "written": 0,
        "unreadable": 1,
        "low_information": 0,
    }
    low = lance.dataset(quality_table).to_table(columns=["id"], filter=Q.LOW_INFORMATION_SQL)
    assert sorted(low["id"].to_pylist()) == ["b/logo", "b/overlay"]

    report = resolution.compute(quality_table)
    q = report.quality
    assert q["measured"] == 6 and q["not_measured"] == 1 and q["low_information"] == 2
    assert q["blank_std"] == 1  # the overlay; the logo is caught by `flat`
    assert sum(q["std"]["counts"]) == 6
    text = resolution.format_report(report)
    assert "low-information 2" in text
    paths = resolution.plot(report, str(tmp_path / "plots"))
    assert any(p.endswith("quality.png") for p in paths)


def test_export_counts_blank_samples_and_skips_build_a_blank_list(quality_table, tmp_path, capsys):
    compute_quality(
        quality_table,
        run=RunOptions(progress=False),
    )
    out = str(tmp_path / "export")
    cfg = prepare_output(
        ExportConfig(table=quality_table, out=out, tiers=(512,), rows_per_task=4)
    ).cfg
    results = {u.part: export_unit(cfg, u) for u in plan_units(cfg)}
    report = finalize(cfg, results, 0.0)
    assert report.samples_written == 6 and report.notes.get("blank") == 2
    assert "blank" in report.table_text()
    with open(os.path.join(out, "report.json")) as f:
        assert json.load(f)["notes"]["blank"] == 2

    # The documented recipe: one step from the quality column to a `blank` skip list.
    where = Q.LOW_INFORMATION_SQL
    assert skips_cli.main(["add", out, "blank", "--table", quality_table, "--where", where]) == 0
    assert "blank: 2 samples" in capsys.readouterr().out
    assert skips_cli.main(["stats", out, "--name", "blank", "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert sum(r["skipped"] for r in stats["blank"]) == 2
    assert skips_cli.main(["add", out, "blank2", "--table", quality_table, "--where",
                           "image_quality.std < 3"]) == 0  # fmt: skip
    assert "blank2: 1 samples" in capsys.readouterr().out
