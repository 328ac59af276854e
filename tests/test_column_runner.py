"""The column-job runner: written once per fragment, image files untouched, resumable, pinned."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap

import lance
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from prx_data.columns import runner as R
from prx_data.core.errors import PrxDataError
from prx_data.core.runtime import RunOptions

ROWS, PER_FRAGMENT = 40, 8  # 5 fragments


def make_table(uri: str, n: int = ROWS, per_fragment: int = PER_FRAGMENT, start: int = 0) -> str:
    ids = [f"t/{i:04d}" for i in range(start, start + n)]
    images = [b"" if i % 7 == 3 else f"img-{i}".encode() * 3 for i in range(start, start + n)]
    lance.write_dataset(
        pa.table({"id": ids, "image": pa.array(images, pa.large_binary())}),
        uri,
        mode="append" if start else "create",
        max_rows_per_file=per_fragment,
    )
    return uri


SEEN: list[str] = []


def measure(batch: pa.Table) -> pa.Table:
    """A zero-cost model: the image length, or an error for an empty image."""
    SEEN.extend(batch["id"].to_pylist())
    sizes = [len(b) if b else None for b in batch["image"].to_pylist()]
    return pa.table(
        {
            "size": pa.array(sizes, pa.int64()),
            "size_status": pa.array(["ok" if s else "error" for s in sizes], pa.string()),
            "size_error": pa.array([None if s else "image: empty_file" for s in sizes]),
        }
    )


OUTPUTS = pa.schema(
    [
        pa.field("size", pa.int64()),
        pa.field("size_status", pa.string()),
        pa.field("size_error", pa.string()),
    ]
)


def job(uri: str, **kw) -> R.ColumnJob:
    args = dict(
        table=uri,
        outputs=OUTPUTS,
        read_columns=["id", "image"],
        steps=[R.Step(measure)],
        where="size_status IS NULL",
        run=RunOptions(engine="local", progress=False),
        batch_size=3,
        count_column="size_status",
        reason_column="size_error",
    )
    args.update(kw)
    return R.ColumnJob(**args)


def values(uri: str) -> dict[str, tuple]:
    t = lance.dataset(uri).to_table(columns=["id", "size", "size_status", "size_error"])
    return {r["id"]: (r["size"], r["size_status"], r["size_error"]) for r in t.to_pylist()}


def expected(i: int) -> tuple:
    if i % 7 == 3:
        return (None, "error", "image: empty_file")
    return (len(f"img-{i}") * 3, "ok", None)


def data_files(uri: str) -> dict[str, str]:
    root = os.path.join(uri, "data")
    return {
        name: hashlib.sha256(open(os.path.join(root, name), "rb").read()).hexdigest()
        for name in os.listdir(root)
    }


def image_files(uri: str) -> set[str]:
    ds = lance.dataset(uri)
    image_field = ds.lance_schema.field("image").id()
    return {
        f.path
        for frag in ds.get_fragments()
        for f in frag.metadata.data_files()
        if image_field in f.field_ids()
    }


def test_each_fragment_written_once_image_files_untouched(tmp_path):
    uri = make_table(str(tmp_path / "t.lance"))
    before = data_files(uri)
    images_before = image_files(uri)
    v0 = lance.dataset(uri).version
    SEEN.clear()
    rep = R.run_column_job(job(uri, commit_every=2))
    assert rep.rows == rep.pending == rep.written == ROWS
    assert sorted(SEEN) == sorted(values(uri))  # every row computed exactly once
    assert rep.fragments == rep.fragments_written == ROWS // PER_FRAGMENT
    assert rep.commits == 3  # 5 fragments, 2 per commit
    # One version for the new (metadata-only) columns, then one per commit.
    assert lance.dataset(uri).version == v0 + 1 + rep.commits
    assert rep.counts == {"ok": 34, "error": 6} and rep.reasons == {"image: empty_file": 6}
    assert values(uri) == {f"t/{i:04d}": expected(i) for i in range(ROWS)}
    # Image data files: the same files, byte for byte, still the ones the table reads.
    after = data_files(uri)
    assert {k: after[k] for k in before} == before
    assert image_files(uri) == images_before
    # New files: one per fragment, holding only the output columns.
    new = set(after) - set(before)
    assert len(new) == rep.fragments_written
    assert sum(os.path.getsize(os.path.join(uri, "data", f)) for f in new) == rep.bytes_written
    # Nothing left to do; no checkpoint left behind.
    assert R.run_column_job(job(uri)).rows == 0
    assert not os.listdir(R.checkpoint_root(uri, "size"))


class Boom(RuntimeError):
    pass


def test_failure_after_n_fragments_resumes_without_redoing_them(tmp_path):
    uri = make_table(str(tmp_path / "t.lance"))

    def fail_after_two(fragment: int, done: int) -> None:
        if done == 2:
            raise Boom("injected after 2 fragments")

    SEEN.clear()
    with pytest.raises(Boom):
        R.run_column_job(job(uri, commit_every=100, on_fragment=fail_after_two))
    first = list(SEEN)
    done = {k for k, v in values(uri).items() if v[1] is not None}
    assert len(done) == 2 * PER_FRAGMENT  # the finished fragments were committed on the way out
    SEEN.clear()
    rep = R.run_column_job(job(uri))
    assert rep.rows == ROWS - len(done)
    assert not set(SEEN) & done  # finished fragments were not computed again
    assert set(first) | set(SEEN) == set(values(uri))
    assert values(uri) == {f"t/{i:04d}": expected(i) for i in range(ROWS)}


KILL_SCRIPT = textwrap.dedent(
    """
    import os, sys
    sys.path.insert(0, {root!r})
    from tests import test_column_runner as T
    from prx_data.columns import runner as R

    def kill(fragment, done):
        if done == 3:
            os._exit(9)  # like SIGKILL: no cleanup, nothing committed

    R.run_column_job(T.job({uri!r}, commit_every=100, on_fragment=kill))
    """
)


def test_killed_run_commits_its_checkpoints_without_recomputing(tmp_path):
    uri = make_table(str(tmp_path / "t.lance"))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = KILL_SCRIPT.format(root=root, uri=uri)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert r.returncode == 9, r.stderr[-2000:]
    # Killed before any commit: no values yet, three fragments checkpointed.
    assert all(v[1] is None for v in values(uri).values())
    ckpts = sorted(os.listdir(R.checkpoint_root(uri, "size")))
    assert len(ckpts) == 3
    rec = json.loads(open(os.path.join(R.checkpoint_root(uri, "size"), ckpts[0])).read())
    assert rec["rows"] == PER_FRAGMENT and rec["read_version"] == lance.dataset(uri).version

    SEEN.clear()
    rep = R.run_column_job(job(uri))
    assert rep.recovered_fragments == 3 and rep.recovered_rows == 3 * PER_FRAGMENT
    assert rep.rows == ROWS - 3 * PER_FRAGMENT == len(SEEN)
    assert values(uri) == {f"t/{i:04d}": expected(i) for i in range(ROWS)}
    assert not os.listdir(R.checkpoint_root(uri, "size"))


def test_stale_checkpoint_is_recomputed_not_committed(tmp_path):
    uri = make_table(str(tmp_path / "t.lance"))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = KILL_SCRIPT.format(root=root, uri=uri)
    assert subprocess.run([sys.executable, "-c", script], timeout=300).returncode == 9
    # The table changes under the checkpoints: compaction rewrites every fragment.
    lance.dataset(uri).optimize.compact_files(target_rows_per_fragment=1000)
    SEEN.clear()
    rep = R.run_column_job(job(uri))
    assert rep.recovered_fragments == 0 and rep.rows == ROWS
    assert values(uri) == {f"t/{i:04d}": expected(i) for i in range(ROWS)}


def test_pinned_version_leaves_rows_appended_during_the_job_alone(tmp_path):
    uri = make_table(str(tmp_path / "t.lance"))
    appended = []

    def append_once(fragment: int, done: int) -> None:
        if done == 1:  # another writer appends while the job runs
            make_table(uri, n=10, per_fragment=10, start=ROWS)
            appended.append(lance.dataset(uri).version)

    rep = R.run_column_job(job(uri, commit_every=1, on_fragment=append_once))
    assert appended and rep.rows == ROWS and rep.table_version < appended[0]
    got = values(uri)
    assert len(got) == ROWS + 10
    assert all(got[f"t/{i:04d}"] == expected(i) for i in range(ROWS))
    # The new rows were not touched at all: every output column is still null.
    assert all(got[f"t/{i:04d}"] == (None, None, None) for i in range(ROWS, ROWS + 10))
    rep2 = R.run_column_job(job(uri))
    assert rep2.rows == 10 and rep2.table_version > rep.table_version
    assert all(values(uri)[f"t/{i:04d}"] == expected(i) for i in range(ROWS + 10))


def test_limit_row_ranges_and_partial_fragments(tmp_path):
    uri = make_table(str(tmp_path / "t.lance"), per_fragment=20)
    rep = R.run_column_job(job(uri, limit=25, rows_per_unit=6))
    assert rep.rows == 25 and rep.units == 4 + 1  # 20 rows in 4 ranges, then 5 rows
    got = values(uri)
    assert sum(v[1] is not None for v in got.values()) == 25
    # Rows are taken in table order; the second fragment is written for its first 5 rows.
    assert all(got[f"t/{i:04d}"] == expected(i) for i in range(25))
    assert R.run_column_job(job(uri, rows_per_unit=6)).rows == ROWS - 25
    assert values(uri) == {f"t/{i:04d}": expected(i) for i in range(ROWS)}


def test_step_contract_and_type_checks(tmp_path):
    uri = make_table(str(tmp_path / "t.lance"))

    def drops_rows(batch):
        return measure(batch).slice(1)

    # The user's step broke the contract: one line naming the unit, not a traceback.
    with pytest.raises(PrxDataError, match="one row per input row"):
        R.run_column_job(job(uri, steps=[R.Step(drops_rows)]))
    lance.dataset(uri).add_columns([pa.field("other", pa.string())])
    with pytest.raises(ValueError, match="this job writes"):
        R.run_column_job(job(uri, outputs=pa.schema([pa.field("other", pa.int64())])))
    with pytest.raises(ValueError, match="engine"):
        job(uri, run=RunOptions(engine="spark"))


@pytest.mark.ray
@pytest.mark.usefixtures("ray_local")
def test_ray_engine_matches_local(tmp_path):
    a = make_table(str(tmp_path / "a.lance"))
    b = make_table(str(tmp_path / "b.lance"))
    ra = R.run_column_job(job(a))
    rb = R.run_column_job(
        job(b, run=RunOptions(engine="ray", progress=False), rows_per_unit=5, commit_every=2)
    )
    assert ra.rows == rb.rows == ROWS and rb.units == 10
    assert ra.counts == rb.counts and ra.reasons == rb.reasons
    assert values(a) == values(b)
    sizes = pc.sum(lance.dataset(b).to_table(columns=["size"])["size"]).as_py()
    assert sizes == sum(v[0] or 0 for v in values(a).values())


def test_outputs_stored_with_the_images_are_moved_out_not_rewritten(tmp_path):
    """A table written with the output columns in its image files keeps those files as they are."""
    uri = str(tmp_path / "t.lance")
    n = 12
    done = [i % 3 == 0 for i in range(n)]
    lance.write_dataset(
        pa.table(
            {
                "id": [f"t/{i:04d}" for i in range(n)],
                "image": pa.array(
                    [b"" if i % 7 == 3 else f"img-{i}".encode() * 3 for i in range(n)],
                    pa.large_binary(),
                ),
                "size": pa.array([7 if d else None for d in done], pa.int64()),
                "size_status": pa.array(["ok" if d else None for d in done]),
                "size_error": pa.nulls(n, pa.string()),
            }
        ),
        uri,
        max_rows_per_file=5,
    )
    before = data_files(uri)
    images_before = image_files(uri)
    rep = R.run_column_job(job(uri))
    assert rep.rows == n - sum(done)
    got = values(uri)
    for i in range(n):
        want = (7, "ok", None) if done[i] else expected(i)
        assert got[f"t/{i:04d}"] == want
    after = data_files(uri)
    assert {k: after[k] for k in before} == before and image_files(uri) == images_before


def test_nested_outputs_take_the_update_columns_path(tmp_path):
    uri = make_table(str(tmp_path / "t.lance"))
    kind = pa.struct([("size", pa.int64()), ("even", pa.bool_())])

    def describe(batch):
        sizes = [len(b) for b in batch["image"].to_pylist()]
        return pa.table({"shape": pa.array([{"size": s, "even": s % 2 == 0} for s in sizes], kind)})

    outputs = pa.schema([pa.field("shape", kind)])
    rep = R.run_column_job(
        job(
            uri,
            outputs=outputs,
            steps=[R.Step(describe)],
            where="shape IS NULL",
            count_column=None,
            reason_column=None,
        )
    )
    assert rep.rows == ROWS and rep.fragments_written == ROWS // PER_FRAGMENT
    t = lance.dataset(uri).to_table(columns=["image", "shape"]).to_pylist()
    assert all(r["shape"] == {"size": len(r["image"]), "even": len(r["image"]) % 2 == 0} for r in t)


class BrokenModel:
    """A step whose model fails to load (a wrong --model): it fails before any row."""

    def __init__(self) -> None:
        raise Boom("cannot load the model")

    def __call__(self, batch: pa.Table) -> pa.Table:  # pragma: no cover - never reached
        return measure(batch)


def test_job_failing_before_its_first_write_leaves_the_table_as_it_was(tmp_path):
    uri = make_table(str(tmp_path / "t.lance"))
    ds0 = lance.dataset(uri)
    with pytest.raises(Boom):
        R.run_column_job(job(uri, steps=[R.Step(BrokenModel)], where=None))
    ds = lance.dataset(uri)
    assert ds.version == ds0.version and ds.schema == ds0.schema  # no columns, no version
    # The same job with a working step adds its columns with the first write.
    rep = R.run_column_job(job(uri, where=None, commit_every=100))
    assert rep.written == ROWS and rep.commits == 1
    assert lance.dataset(uri).version == ds0.version + 2  # the columns, then the one commit
    assert values(uri) == {f"t/{i:04d}": expected(i) for i in range(ROWS)}


def test_one_pending_filter_spells_every_job_s_pending_rows():
    from prx_data.columns.writeback import pending_filter
    from prx_data.pipelines import dedup, download

    names = ["id", "phash", "phash_error"]
    assert dedup.pending_filter(names) == "`phash` IS NULL AND `phash_error` IS NULL"
    assert dedup.pending_filter(names, redo_errors=True) == "`phash` IS NULL"
    assert dedup.pending_filter(["id"]) is None
    assert download.pending_filter("url") == (
        "`download_status` IS NULL AND `url` IS NOT NULL AND `probe_error` = 'missing_image'"
    )
    only = download.pending_filter("url", ["failed", "http_4*"])
    assert only.startswith("(`download_status` IN ('transient', 'permanent', 'refused') OR ")
    assert "`download_error` LIKE 'http\\_4%')" in only
    assert "IS NULL" not in only  # never-tried rows are left for a normal run
    sql = pending_filter(["s"], "s", redo=["x"], redo_where=["e = 'y'"], match=["m = 1"])
    assert sql == "(`s` IS NULL OR `s` IN ('x') OR e = 'y') AND m = 1"
    assert pending_filter([], "s", include_missing=False, redo_where=["e = 'y'"]) == "false"
