"""``skips rewrite`` as a re-shard stage: encoded samples copied, packs resumable, any placement.

The rewrite runs one pack per kept source part through ``core.runtime.map_units``
(:mod:`prx_data.skips.repack`); these tests pin what that buys: no sample is
decoded to copy it, an interrupted rewrite resumes from its pack markers, and
Ray writes the same bytes as the driver's threads.
"""

from __future__ import annotations

import os

import pytest

from prx_data.core.errors import UsageError
from prx_data.export import layout
from prx_data.skips import repack
from prx_data.skips import rewrite as R
from tests.exportkit import make_export, skip_samples

B1, B2 = "512/1.000", "512/0.500"


@pytest.fixture()
def export(tmp_path):
    ex = make_export(
        str(tmp_path / "src"), {B1: 40, B2: 24}, samples_per_part=8, samples_per_shard=3
    )
    skip_samples(ex.root, "dedup", ids=[f"ds/{B1}/{i}" for i in range(0, 40, 3)])
    skip_samples(ex.root, "optout", ids=[f"ds/{B2}/{i}" for i in range(8)])  # a whole part
    return ex


def test_samples_are_copied_encoded_never_decoded(export, tmp_path, monkeypatch):
    from prx_data.core.streaming_compat import MDSReader

    reference = R.rewrite_export(export.root, str(tmp_path / "ref"), force=True)

    def refuse(self, idx):  # test double: any decode of a sample fails the rewrite
        raise AssertionError("a sample was decoded")

    monkeypatch.setattr(MDSReader, "get_item", refuse)
    out = str(tmp_path / "out")
    r = R.rewrite_export(export.root, out, force=True, verify=False)
    assert r.samples_out == reference.samples_out == 64 - 14 - 8 and not r.verified
    assert layout.content_digest(out) == layout.content_digest(reference.out)


def test_an_interrupted_rewrite_resumes_from_its_pack_markers(export, tmp_path, monkeypatch):
    reference = R.rewrite_export(export.root, str(tmp_path / "ref"), force=True)
    real = repack._write
    written: list[str] = []
    dying = [True]

    def dies_at_the_fourth(job, pack, staging):  # test double: the job dies mid-way, once
        if dying[0] and len(written) == 3:
            dying[0] = False
            raise ConnectionError("injected")
        real(job, pack, staging)
        written.append(f"{pack.bucket}/{pack.part}")

    monkeypatch.setattr(repack, "_write", dies_at_the_fourth)
    out = str(tmp_path / "out")
    with pytest.raises(ConnectionError):
        R.rewrite_export(export.root, out, force=True, engine="local", num_cpus=1)
    assert not layout.is_complete(out) and len(written) == 3
    # Without --resume the unfinished tree is refused, as before.
    with pytest.raises(FileExistsError, match="not empty"):
        R.rewrite_export(export.root, out, force=True)
    # Another plan (one list fewer applied) is not mixed into it.
    with pytest.raises(UsageError, match="another plan"):
        R.rewrite_export(export.root, out, names=["dedup"], force=True, resume=True)
    first = list(written)
    r = R.rewrite_export(export.root, out, force=True, resume=True)
    assert len(written) == 7  # 7 packs (5 + 2 kept parts): the resume wrote only the 4 unmarked
    assert not set(first) & set(written[3:])
    assert r.samples_out == reference.samples_out and r.buckets_dropped == reference.buckets_dropped
    assert layout.content_digest(out) == layout.content_digest(reference.out)
    assert not os.path.exists(os.path.join(out, "_progress"))  # the plan and markers went
    with pytest.raises(FileExistsError, match="finished rewrite"):
        R.rewrite_export(export.root, out, force=True, resume=True)


def test_resume_needs_an_unfinished_rewrite(export, tmp_path):
    with pytest.raises(UsageError, match="no unfinished rewrite"):
        R.rewrite_export(export.root, str(tmp_path / "nothing"), force=True, resume=True)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ray_writes_the_same_export_as_driver_threads(export, tmp_path):
    local = R.rewrite_export(export.root, str(tmp_path / "local"), force=True, engine="local")
    on_ray = R.rewrite_export(
        export.root, str(tmp_path / "ray"), force=True, engine="ray", num_cpus=2
    )
    assert on_ray.verified and on_ray.to_dict()["buckets"] == local.to_dict()["buckets"]
    assert layout.content_digest(on_ray.out) == layout.content_digest(local.out)
