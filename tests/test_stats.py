"""prx_data.table.resolution: distributions, would-be drops, plots and the CLI."""

from __future__ import annotations

import json
import os

import lance
import pyarrow as pa
import pytest

from prx_data.cli import stats as stats_cli
from prx_data.table import resolution as stats

SIZES = [
    (1000, 1000),
    (1000, 1000),
    (300, 300),
    (3000, 1000),
    (400, 400),
    (2000, 1000),
    (None, None),
]


def _table(path: str) -> str:
    uri = os.path.join(path, "t.lance")
    lance.write_dataset(
        pa.table(
            {
                "id": [f"s/{i}" for i in range(len(SIZES))],
                "width": pa.array([w for w, _ in SIZES], pa.int32()),
                "height": pa.array([h for _, h in SIZES], pa.int32()),
                "probe_error": [None] * (len(SIZES) - 1) + ["truncated"],
            }
        ),
        uri,
        max_rows_per_file=3,
    )
    return uri


def test_compute_counts_tiers_buckets_and_drops(tmp_path):
    report = stats.compute(_table(str(tmp_path)))
    assert report.rows == 7
    assert report.tiers == {"512": 1, "1024": 3}
    assert report.buckets == {"1024/1.000": 2, "1024/2.000": 1, "512/1.000": 1}
    assert report.drops == {"aspect_ratio": 1, "too_small": 1, "unreadable": 1}
    assert sum(report.megapixels["counts"]) == 6 and sum(report.aspect_ratio["counts"]) == 6
    assert report.fragments["fragments"] == 3
    text = stats.format_report(report)
    assert "drop:too_small" in text and "1024/2.000" in text and "fragments 3" in text


def test_cli_writes_plots_and_json(tmp_path, capsys):
    uri = _table(str(tmp_path))
    out = str(tmp_path / "out")
    assert stats_cli.main(["--table", uri, "--out", out, "--tiers", "512,1024"]) == 0
    for name in ("resolution.png", "aspect_ratio.png", "tiers.png", "fragments.png"):
        with open(os.path.join(out, name), "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    with open(os.path.join(out, "stats.json")) as f:
        saved = json.load(f)
    # With tiers 512/1024 only, the 3000x1000 image is still an aspect-ratio drop.
    assert saved["tiers"] == {"512": 1, "1024": 3}
    assert "rows 7" in capsys.readouterr().out


def test_plot_axes_fit_the_data_and_fragments_show_bytes(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    uri = _table(str(tmp_path))
    report = stats.compute(uri)
    edges = report.megapixels["edges"]
    # Data spans 0.09-3 MP: the axis is fitted to it, not 0.01-100 MP.
    assert 0.05 < edges[0] < 0.09 and 3.0 < edges[-1] < 5.0
    saved: dict[str, object] = {}
    real_save = stats._save

    def keep(fig, out_dir, name):
        saved[name] = [
            (a.get_xlim(), list(a.get_xticks()), [t.get_text() for t in a.texts], a.get_ylabel())
            for a in fig.axes
        ]
        return real_save(fig, out_dir, name)

    stats._save = keep
    try:
        stats.plot(report, str(tmp_path / "p"))
        # One fragment: integer ticks only.
        lance.dataset(uri).optimize.compact_files(target_rows_per_fragment=100)
        one = stats.compute(uri)
        assert one.fragments["fragments"] == 1
        stats.plot(one, str(tmp_path / "q"))
    finally:
        stats._save = real_save
    res = saved["resolution.png"][0]
    assert res[0][0] == pytest.approx(edges[0]) and res[0][1] == pytest.approx(edges[-1])
    assert any("512 tier" in t for t in res[2]) and any("1024 tier" in t for t in res[2])
    frag = saved["fragments.png"]
    assert [a[3] for a in frag] == ["rows", "MB"]  # rows and bytes per fragment
    assert all(float(t).is_integer() for a in frag for t in a[1])
    assert plt.get_fignums() == []


def test_every_numeric_column_is_plotted_with_marked_thresholds(tmp_path, capsys):
    """Float columns and float struct fields are found from the schema; --mark counts exactly."""
    uri = _table(str(tmp_path))
    n = len(SIZES)
    aesthetic = [3.0, 4.0, 5.0, 5.5, 6.0, None, 7.0]
    quality = [{"std": float(10 * i), "entropy": 1.0, "flat": 0.1} for i in range(n)]
    from prx_data.table.lance_ops import update_column

    ids = [f"s/{i}" for i in range(n)]
    update_column(
        uri,
        "aesthetic_score",
        pa.table({"id": ids, "aesthetic_score": pa.array(aesthetic, pa.float32())}),
    )
    qtype = pa.struct([pa.field(f, pa.float32()) for f in ("std", "entropy", "flat")])
    update_column(
        uri, "image_quality", pa.table({"id": ids, "image_quality": pa.array(quality, qtype)})
    )
    assert stats.numeric_columns(lance.dataset(uri).schema) == [
        "aesthetic_score",
        "image_quality.std",
        "image_quality.entropy",
        "image_quality.flat",
    ]
    out = str(tmp_path / "out")
    args = ["--table", uri, "--out", out, "--mark", "aesthetic=5", "--mark", "image_quality.std=25"]
    assert stats_cli.main(args) == 0
    with open(os.path.join(out, "scores.png"), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    with open(os.path.join(out, "stats.json")) as f:
        scores = json.load(f)["scores"]
    assert set(scores) == {
        "aesthetic_score",
        "image_quality.std",
        "image_quality.entropy",
        "image_quality.flat",
    }
    [m] = scores["aesthetic_score"]["marks"]
    assert (m["threshold"], m["above"], m["below"]) == (5.0, 4, 2)
    assert m["share_above"] == pytest.approx(4 / 6)
    assert scores["image_quality.std"]["marks"][0]["above"] == 4  # 30, 40, 50, 60
    assert "marks" not in scores["image_quality.flat"]
    text = capsys.readouterr().out
    assert ">= 5: 4 (66.7%), below: 2" in text
    for bad in ("nope=1", "aesthetic", "aesthetic=high"):
        assert stats_cli.main(["--table", uri, "--out", out, "--mark", bad]) == 2
    assert "no numeric column 'nope'" in capsys.readouterr().err
