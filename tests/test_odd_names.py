"""A file name that is not UTF-8 is one line naming it, whichever job meets it.

Python hands such a name over with surrogate escapes; Arrow and Lance take
UTF-8 paths only and fail deep down with an encoding error that names no
path. Every job's CLI turns that into one line with the name as the file
system holds it (its bytes), and exit 2.
"""

from __future__ import annotations

import os
import sys

import pytest

from prx_data.cli import JOBS

pytestmark = pytest.mark.skipif(
    sys.platform != "linux", reason="needs a file system that keeps non-UTF-8 names"
)


@pytest.fixture
def odd_dir(tmp_path):
    raw = os.path.join(os.fsencode(tmp_path), b"ph\xffotos")
    os.mkdir(raw)
    with open(os.path.join(raw, b"a.jpg"), "wb") as f:
        f.write(b"\xff\xd8\xff\xd9")
    return os.fsdecode(raw)


@pytest.mark.parametrize(
    "job, argv",
    [
        ("ingest", ["{d}", "--table", "{tmp}/t.lance"]),
        ("skips", ["list", "{d}"]),
        ("skips", ["stats", "{d}"]),
        ("skips", ["add", "{d}", "optout-1", "--ids", "{tmp}/ids.txt"]),
    ],
)
def test_a_non_utf8_path_is_one_line_naming_its_bytes(job, argv, odd_dir, tmp_path, capsys):
    (tmp_path / "ids.txt").write_text("demo/img_0000\n")
    args = [a.format(d=odd_dir, tmp=tmp_path) for a in argv]
    assert JOBS[job].main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0, err
    assert err.startswith("error: path b'") and "ph\\xffotos" in err and "not valid UTF-8" in err
