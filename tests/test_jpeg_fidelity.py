"""JPEG quality estimation (libjpeg table match) and the re-encoding fidelity report."""

from __future__ import annotations

import io
import json

import cv2
import numpy as np
import pytest
from PIL import Image

from prx_data.cli import jpeg_fidelity as JC
from prx_data.core.imaging import ImageError, encode
from prx_data.export import fidelity as J
from tests.dedup_images import jpeg, make_image, png
from tests.tablekit import make_table


@pytest.fixture(scope="module")
def picture() -> Image.Image:
    return make_image(42, 120, 96)


def test_every_pillow_quality_is_recovered_exactly(picture):
    for q in range(1, 101):
        est = J.estimate_quality(jpeg(picture, q))
        assert (est.quality, est.exact, est.distance) == (q, True, 0.0), q


def test_exporter_output_is_q92_for_every_subsampling_and_mode(picture):
    for sub in (-1, 0, 1, 2):
        assert J.estimate_quality(encode(picture, "jpeg", 92, sub)).quality == 92
    gray = J.estimate_quality(jpeg(picture.convert("L"), 92))
    assert gray.quality == 92 and gray.exact and gray.tables == 1
    # Other libjpeg-based encoders write the same tables.
    for q in (35, 80, 97):
        ok, buf = cv2.imencode(
            ".jpg", np.asarray(picture)[..., ::-1], [cv2.IMWRITE_JPEG_QUALITY, q]
        )
        assert ok and J.estimate_quality(buf.tobytes()).quality == q
    # A path and an opened image work too.
    assert J.estimate_quality(Image.open(io.BytesIO(jpeg(picture, 61)))).quality == 61


def test_non_libjpeg_tables_get_nearest_quality(picture, tmp_path):
    luma, chroma = J.libjpeg_tables(75)
    odd = [list(np.minimum(luma + (np.arange(64) % 3 == 0), 255)), list(chroma)]
    buf = io.BytesIO()
    picture.save(buf, "JPEG", qtables=odd)
    est = J.estimate_quality(buf.getvalue())
    assert est.quality == 75 and not est.exact and 0 < est.distance < 1
    path = tmp_path / "x.jpg"
    path.write_bytes(buf.getvalue())
    assert J.estimate_quality(str(path)).quality == 75
    with pytest.raises(ImageError) as e:
        J.estimate_quality(png(picture))
    assert e.value.reason == "not_a_jpeg"
    with pytest.raises(ImageError) as e:
        J.estimate_quality(b"nothing")
    assert e.value.reason == "not_an_image"
    with pytest.raises(ValueError):
        J.libjpeg_tables(0)


def test_psnr_and_bands():
    a = np.full((8, 8, 3), 100, np.uint8)
    assert J.psnr(a, a) == J.PSNR_CAP
    assert J.psnr(a, a + 1) == pytest.approx(10 * np.log10(255**2), abs=1e-9)  # MSE 1
    assert J.psnr(a, a + 2) == pytest.approx(10 * np.log10(255**2 / 4), abs=1e-9)
    with pytest.raises(ValueError):
        J.psnr(a, a[:4])
    assert J.band_of(100 * 100) == "<0.25 MP"
    assert J.band_of(250_000) == "0.25-0.5 MP"
    assert J.band_of(1_500_000) == "1-2 MP"
    assert J.band_of(2_000_000) == "2-4 MP"
    assert J.band_of(20_000_000) == ">=16 MP"


def test_more_cycles_lose_more_and_higher_quality_loses_less():
    im = make_image(3, 400, 300)
    ref = np.asarray(im)
    outs = J.reencode(im, 92, [1, 10])
    p1, p10 = J.psnr(ref, np.asarray(outs[1])), J.psnr(ref, np.asarray(outs[10]))
    assert p10 < p1
    hi = J.psnr(ref, np.asarray(J.reencode(im, 98, [1])[1]))
    lo = J.psnr(ref, np.asarray(J.reencode(im, 60, [1])[1]))
    assert lo < p1 < hi
    with pytest.raises(ValueError):
        J.reencode(im, 92, [0])


def test_folder_report_by_band_with_bad_files(tmp_path, capsys):
    sizes = [(600, 500), (640, 480), (1300, 1000), (200, 150)]
    for i, (w, h) in enumerate(sizes):
        (tmp_path / f"{i}.png").write_bytes(png(make_image(i, w, h)))
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "q70.jpg").write_bytes(jpeg(make_image(9, 620, 480), 70))
    (tmp_path / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 broken")
    (tmp_path / "notes.txt").write_text("not an image, not listed")
    out = tmp_path / "r.json"
    assert (
        JC.main(["--folder", str(tmp_path), "--json", str(out), "--no-progress", "--no-lpips"]) == 0
    )
    rep = json.loads(out.read_text())
    assert rep["images"] == 5 and sum(rep["errors"].values()) == 1
    assert {k: v["images"] for k, v in rep["bands"].items()} == {
        "<0.25 MP": 1,
        "0.25-0.5 MP": 3,
        "1-2 MP": 1,
    }
    assert rep["source_quality"] == {"70": 1}
    for b in rep["bands"].values():
        assert b["psnr_mean"]["10"] < b["psnr_mean"]["1"] < J.PSNR_CAP
    text = capsys.readouterr().out
    assert "PSNR@1" in text and "48.7 / 45.4" in text


def test_table_source_and_quality_cli(tmp_path, capsys):
    items = [(f"t/{i}", jpeg(make_image(i, 500 + 10 * i, 400), 85), None) for i in range(4)]
    items.append(("t/bad", b"junk", None))
    uri = str(tmp_path / "t.lance")
    make_table(uri, items)
    rep = J.run_fidelity(
        J.FidelityConfig(table=uri, limit=3, cycles=(1, 2), lpips="off", progress=False)
    )
    assert rep.images + sum(rep.errors.values()) == 3 and rep.cycles == [1, 2]
    f = tmp_path / "a.jpg"
    f.write_bytes(encode(make_image(1, 64, 64), "jpeg", 92))
    assert JC.main(["--estimate-quality", str(f), str(tmp_path / "missing.jpg")]) == 0
    printed = capsys.readouterr().out
    assert f"{f}: q92" in printed and "missing.jpg" in printed
    with pytest.raises(ValueError):
        J.FidelityConfig(folder="a", table="b")
    with pytest.raises(SystemExit):
        JC.main(["--help"])
    help_text = capsys.readouterr().out
    for opt in (
        "--folder",
        "--table",
        "--estimate-quality",
        "--quality",
        "--cycles",
        "--subsampling",
        "--limit",
    ):
        assert opt in help_text


def test_band_medians_are_not_skewed_by_identical_images(tmp_path, capsys):
    from PIL import Image

    # Two flat images come back bit-identical (scored at the cap); three photos do not.
    for i in range(2):
        Image.new("RGB", (600, 500), (128, 128, 128)).save(tmp_path / f"flat{i}.png")
    for i in range(3):
        (tmp_path / f"p{i}.png").write_bytes(png(make_image(i, 600, 500)))
    rep = J.run_fidelity(
        J.FidelityConfig(folder=str(tmp_path), cycles=(1,), lpips="off", progress=False)
    )
    b = rep.bands["0.25-0.5 MP"]
    assert b.images == 5 and b.identical == {1: 2}
    assert b.psnr_median[1] < 60 < b.psnr_mean[1]  # the mean is dragged up by the two 99s
    assert b.psnr_min[1] <= b.psnr_median[1]
    text = rep.text()
    assert "median" in text and "2 at @1 identical" in text
