"""Export workers get streaming's MDSWriter without the package's datasets (transformers...).

The contract of ``streaming_compat``'s deferred package ``__init__``: the writer
alone loads light, and a later ``import streaming`` is the whole package.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

_PROBE = """
import json, sys
from prx_data.core.streaming_compat import mds_writer
W = mds_writer()
light = sorted(m for m in ("transformers", "streaming.text", "streaming.base.dataset") if m in sys.modules)
import streaming
from streaming import StreamingDataset
print(json.dumps({
    "light": light,
    "same_class": streaming.MDSWriter is W,
    "version": streaming.__version__,
    "dataset": StreamingDataset.__module__,
    "text": "streaming.text" in sys.modules,
}))
"""


def test_writer_loads_without_the_datasets_and_the_package_still_imports_whole():
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, (repo, os.environ.get("PYTHONPATH")))),
    }
    out = subprocess.run(
        [sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, check=True
    )
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["light"] == []  # the writer alone: no tokenizer stack, no datasets
    # A later `import streaming` is the whole package, with the very same writer class.
    assert got["same_class"] and got["version"].startswith("0.13.")
    assert got["dataset"] == "streaming.base.dataset" and got["text"]


def test_writer_in_a_process_that_already_imported_streaming_is_the_package_one():
    import streaming

    from prx_data.core.streaming_compat import mds_writer

    assert mds_writer() is streaming.MDSWriter
