"""examples/mixing.ipynb runs top to bottom (executed with nbclient, as CI does)."""

from __future__ import annotations

import os

import nbformat
from nbclient import NotebookClient

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_mixing_notebook_executes(tmp_path):
    nb = nbformat.read(os.path.join(REPO, "examples", "mixing.ipynb"), as_version=4)
    NotebookClient(
        nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    ).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    text = "".join(o.get("text", "") for o in outputs if o.get("output_type") == "stream")
    assert "batch shapes" in text and "epoch:" in text
    # The plot was drawn, and written to a file.
    assert any("image/png" in o.get("data", {}) for o in outputs)
    path = text.split("plot written to ", 1)[1].split()[0]
    assert path == str(tmp_path / "mixing.png")  # the working folder, where it says
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert "requested" in text and "realised" in text
    assert "photos " in text and "art " in text  # the plan names each dataset in full
    # It runs from the package: nothing is imported from tests/.
    assert "tests" not in "".join(c.source for c in nb.cells if c.cell_type == "code")
