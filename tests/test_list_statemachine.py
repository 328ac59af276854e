"""Model-based test of the skip-list log (``hypothesis`` stateful testing).

The model: the registry's state (list -> ids), each export's own
(export-only) overrides, and what each export showed when it was last
materialised. An export-only change of an id holds in its export until a
later registry change of that id; a registry change clears every export's
override of that id (it is newer). Any operation on an export, and ``sync``,
materialises it fully; other exports keep what they showed until theirs.

After every step, for every export, the ids its sidecars skip (read back
through its manifests) and the ids its ``_lists/`` store holds equal the
model; every few steps and at the end, so do the ids the loader leaves out
of each export (:func:`prx_data.stream.sources.load_sources`, the skips the
sample space is built from). Beyond list updates and syncs the rules rewrite
an export (``skips rewrite``, applying ``dedup``), export afresh to a new
folder, append rows to the table, compact the table and the registry, and
replace the dedup list (``dedup --export``). Writers' clocks are skewed at
random: the order is commit order. The short profile runs in the default
suite; the long one is marked slow.
"""

from __future__ import annotations

import datetime as dt
import os
import shutil
import tempfile

import pytest

hypothesis = pytest.importorskip("hypothesis")
import pyarrow as pa  # noqa: E402
from hypothesis import HealthCheck, Phase, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule  # noqa: E402

from prx_data.export import layout  # noqa: E402
from prx_data.skips import sidecar as SL  # noqa: E402
from prx_data.skips.bind import ids_at  # noqa: E402
from prx_data.skips.export_state import export_lease  # noqa: E402
from prx_data.skips.ledger import Ledger  # noqa: E402
from prx_data.skips.log import Provenance  # noqa: E402
from prx_data.skips.materialise import materialise  # noqa: E402
from prx_data.skips.ops import carry, sync, update_list  # noqa: E402
from prx_data.skips.place import read_table_id, registry_uri  # noqa: E402
from tests.exportkit import make_export  # noqa: E402
from tests.tablekit import make_table  # noqa: E402

B = "512/1.000"
TIER = 512
N = 8
EXPORTS = ("a", "b", "c")
LISTS = ("optout", "dedup")
IDS = [f"ds/{B}/{i}" for i in range(N + 2)]  # two ids no export holds

ids_st = st.sets(st.sampled_from(IDS), min_size=1, max_size=4)


class ListLog(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.tmp = tempfile.mkdtemp(prefix="prx-listsm-")
        self.table = os.path.join(self.tmp, "t.lance")
        make_table(self.table, [("s/0", b"\xff\xd8x", "c")])
        self.ex = {}
        for e in EXPORTS:
            root = os.path.join(self.tmp, e)
            shutil.copytree(TEMPLATE.root, root)
            sync(root, self.table)
            self.ex[e] = root
        self.where = TEMPLATE.where
        self.tid = read_table_id(self.table)
        self.reg: dict[str, set[str]] = {}
        self.over: dict[str, dict[tuple[str, str], str]] = {e: {} for e in EXPORTS}
        self.shown: dict[str, dict[str, set[str]]] = {e: {} for e in EXPORTS}
        self.skew = 0.0
        self.gen = 0
        self.steps = 0
        #: The ids each export's tree holds (a rewrite leaves the applied list's samples out).
        self.held = {e: set(TEMPLATE.where) for e in EXPORTS}

    def teardown(self):
        try:
            self.loader_skips_the_model()
        finally:
            shutil.rmtree(self.tmp, ignore_errors=True)

    # --- the model ---------------------------------------------------------------------------

    def view(self, e: str) -> dict[str, set[str]]:
        out = {n: set(v) for n, v in self.reg.items()}
        for (n, i), op in self.over[e].items():
            if op == "add":
                out.setdefault(n, set()).add(i)
            else:
                out.get(n, set()).discard(i)
        return {n: v for n, v in out.items() if v}

    def reg_op(self, n: str, ids: set[str], op: str) -> None:
        if op == "add":
            self.reg.setdefault(n, set()).update(ids)
        else:
            self.reg.get(n, set()).difference_update(ids)
        for e in EXPORTS:
            for i in ids:
                self.over[e].pop((n, i), None)

    def prov(self) -> Provenance:
        return Provenance("model", at=dt.datetime.now(dt.UTC) + dt.timedelta(seconds=self.skew))

    # --- rules ---------------------------------------------------------------------------------

    @rule(delta=st.sampled_from([-3600.0, -60.0, 0.0, 60.0, 86400.0]))
    def skew_clock(self, delta):
        self.skew = delta

    @rule(e=st.sampled_from(EXPORTS), n=st.sampled_from(LISTS), ids=ids_st, only=st.booleans())
    def add(self, e, n, ids, only):
        update_list(self.ex[e], n, sorted(ids), self.prov(), export_only=only)
        if only:
            self.over[e].update({(n, i): "add" for i in ids})
        else:
            self.reg_op(n, ids, "add")
        self.shown[e] = self.view(e)

    @rule(e=st.sampled_from(EXPORTS), n=st.sampled_from(LISTS), ids=ids_st, only=st.booleans())
    def remove_ids(self, e, n, ids, only):
        update_list(self.ex[e], n, sorted(ids), self.prov(), mode="remove", export_only=only)
        if only:
            self.over[e].update({(n, i): "remove" for i in ids})
        else:
            self.reg_op(n, ids, "remove")
        self.shown[e] = self.view(e)

    @rule(e=st.sampled_from(EXPORTS), n=st.sampled_from(LISTS), only=st.booleans())
    def remove_list(self, e, n, only):
        held = set(self.view(e).get(n, set()))
        update_list(self.ex[e], n, None, self.prov(), mode="remove", export_only=only)
        if only:
            self.over[e].update({(n, i): "remove" for i in held})
        else:
            self.reg_op(n, held, "remove")
        self.shown[e] = self.view(e)

    @rule(e=st.sampled_from(EXPORTS))
    def sync(self, e):
        sync(self.ex[e])
        self.shown[e] = self.view(e)

    @rule(e=st.sampled_from(EXPORTS))
    def overwrite(self, e):
        """``write_mds --overwrite``: carry the old tree's entries, a new tree, materialise."""
        reg = Ledger.for_table(self.table)
        carry(self.ex[e], reg)
        for (n, i), op in sorted(self.over[e].items()):
            self.reg_op(n, {i}, op)
        self.gen += 1
        root = os.path.join(self.tmp, f"{e}.{self.gen}")
        shutil.copytree(TEMPLATE.root, root)
        shutil.rmtree(self.ex[e])
        self.ex[e] = root
        with export_lease(root) as lease:
            materialise(root, reg, lease, full=True)
        self.shown[e] = self.view(e)

    @rule(e=st.sampled_from(EXPORTS))
    def reexport(self, e):
        """A fresh export of the table to a new folder: the registry's lists, nothing else."""
        self.gen += 1
        root = os.path.join(self.tmp, f"{e}.{self.gen}")
        shutil.copytree(TEMPLATE.root, root)
        with export_lease(root) as lease:
            materialise(root, Ledger.for_table(self.table), lease, full=True)
        self.ex[e], self.over[e], self.held[e] = root, {}, set(TEMPLATE.where)
        self.shown[e] = self.view(e)

    @rule(e=st.sampled_from(EXPORTS))
    def rewrite(self, e):
        """``skips rewrite`` applying dedup: a new tree without those samples, lists carried."""
        from prx_data.skips.rewrite import rewrite_export

        # Applied: what its sidecars skip and what the log holds now (all its ids leave).
        gone = self.shown[e].get("dedup", set()) | self.view(e).get("dedup", set())
        self.gen += 1
        out = os.path.join(self.tmp, f"{e}.{self.gen}")
        rewrite_export(self.ex[e], out, names=["dedup"], force=True, verify=False)
        for (n, i), op in sorted(self.over[e].items()):
            self.reg_op(n, {i}, op)
        self.ex[e], self.held[e] = out, self.held[e] - gone
        self.shown[e] = self.view(e)

    @rule(e=st.sampled_from(EXPORTS), ids=ids_st)
    def dedup(self, e, ids):
        """``dedup --export``: the dedup list replaced, in one registry commit."""
        gone = self.view(e).get("dedup", set()) - ids
        update_list(self.ex[e], "dedup", sorted(ids), self.prov(), mode="replace")
        self.reg_op("dedup", gone, "remove")
        self.reg_op("dedup", ids, "add")
        self.shown[e] = self.view(e)

    @rule()
    def append_to_table(self):
        import lance

        ds = lance.dataset(self.table)
        row = ds.to_table(limit=1)
        self.gen += 1
        row = row.set_column(0, "id", pa.array([f"s/new{self.gen}"], pa.string()))
        lance.write_dataset(row, self.table, mode="append")
        assert read_table_id(self.table) == self.tid

    @rule()
    def compact(self):
        """Compaction and old-version cleanup of the table and of the registry."""
        import lance

        for uri in (self.table, registry_uri(self.table)):
            if os.path.exists(uri):
                ds = lance.dataset(uri)
                ds.optimize.compact_files()
                lance.dataset(uri).cleanup_old_versions(older_than=dt.timedelta(0))
        assert read_table_id(self.table) == self.tid

    # --- the check -------------------------------------------------------------------------

    @invariant()
    def exports_equal_the_model(self):
        from tests.test_list_model import stored

        self.steps += 1
        for e in EXPORTS:
            want, held = self.shown[e], self.held[e]
            assert stored(self.ex[e]) == want, e
            got = _sidecar_ids(self.ex[e])
            assert got == {n: v & held for n, v in want.items() if v & held}, e
        if self.steps % 4 == 0:
            self.loader_skips_the_model()

    def loader_skips_the_model(self):
        """The ids the loader leaves out of each export, and those it streams, are the model's."""
        from prx_data.stream.sources import load_sources
        from prx_data.stream.spec import DatasetSpec

        for e in EXPORTS:
            want = set().union(*self.shown[e].values()) & self.held[e]
            srcs = load_sources(DatasetSpec(root=self.ex[e]), [TIER])
            positions = {(b.bucket, s): idx for b in srcs for s, idx in b.skips.items()}
            assert set(ids_at(self.ex[e], positions).to_pylist()) == want, e
            streamed = sum(b.samples - b.skipped for b in srcs)
            assert streamed == len(self.held[e] - want), e


def _sidecar_ids(root: str) -> dict[str, set[str]]:
    """{list: ids its sidecars skip}, read back through the export's manifests."""
    out = {}
    for bucket in layout.list_buckets(root):
        shards = layout.read_index(root, bucket)
        for n in SL.list_sidecars(root, bucket, shards):
            got = SL.load_skips(root, bucket, shards, [n])
            ids = set(ids_at(root, {(bucket, s): v for s, v in got.items()}).to_pylist())
            if ids:
                out.setdefault(n, set()).update(ids)
    return out


TEMPLATE = None


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    global TEMPLATE
    TEMPLATE = make_export(
        str(tmp_path_factory.mktemp("tpl") / "ex"), {B: N}, samples_per_part=4, samples_per_shard=2
    )
    yield TEMPLATE
    TEMPLATE = None


_FAST = settings(
    max_examples=3,
    stateful_step_count=10,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    derandomize=True,
)
_LONG = settings(
    max_examples=60,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=list(HealthCheck),
)


@pytest.mark.timeout(300)
def test_list_log_model_short(template):
    ListLog.TestCase.settings = _FAST
    ListLog.TestCase().runTest()


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_list_log_model_long(template):
    ListLog.TestCase.settings = _LONG
    ListLog.TestCase().runTest()


# --- the corpus: an opt-out follows the image -----------------------------------------------
#
# The model: images (each one picture) and the rows that hold them in the tables of one
# corpus folder (an id per row; a row's bytes are the image's own or, for a pHash-equal
# copy, another encoding of it with the same pHash). Opting out any row of an image opts
# out the image. Every export (made by ``write_mds`` from some table) must stream exactly
# the rows it was written with, less every row of an opted-out image; a fresh export must
# write every row of its table but those. The rules change the corpus's shape around the
# ledger: rebuild a table beside the old one, copy a table (alone, or with its folder and
# ledger), delete or replace the ledger, add byte-identical and pHash-equal copies under
# other names, re-ingest under a new source name, receive an export that carries our
# identity, and pause a ledger writer between its read and its commit.

N_IMAGES = 4
PHASH0 = 0x5A5A_0000_0000_0100  # the model's pHash of image k is PHASH0 + k
#: An image never opted out, so every export streams something (an empty one is refused).
KEPT = N_IMAGES - 1


def _jpeg(k: int, quality: int = 90) -> bytes:
    """Image ``k`` (its own pixels), 512-tier; another ``quality`` gives other bytes."""
    import io

    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(9100 + k)
    small = Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8))
    buf = io.BytesIO()
    small.resize((600, 600), Image.Resampling.BICUBIC).save(buf, "JPEG", quality=quality)
    return buf.getvalue()


_BYTES: dict[tuple[int, int], bytes] = {}


def _bytes(img: int, variant: int) -> bytes:
    """Variant 0: the image as ingested; 1: re-encoded (other bytes, same pHash)."""
    if (img, variant) not in _BYTES:
        _BYTES[img, variant] = _jpeg(img, 90 if variant == 0 else 70)
    return _BYTES[img, variant]


def _write_table(path: str, rows: dict[str, tuple[int, int]]) -> str:
    """A table of ``rows`` ({id: (image, variant)}) with a ``phash`` column (the model's)."""
    import lance

    make_table(path, [(i, _bytes(*rows[i]), f"c {i}") for i in sorted(rows)])
    ds = lance.dataset(path)
    ids = ds.to_table(columns=["id"])["id"].to_pylist()
    ph = pa.array([PHASH0 + rows[i][0] for i in ids], pa.int64())
    ds.add_columns(pa.table({"phash": ph}))
    return path


def _append_row(path: str, rid: str, img: int, variant: int) -> None:
    import lance

    tmp = path + f".row-{abs(hash(rid))}"
    _write_table(tmp, {rid: (img, variant)})
    row = lance.dataset(tmp).to_table()
    lance.write_dataset(row, path, mode="append")
    shutil.rmtree(tmp)


class Corpus(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.tmp = tempfile.mkdtemp(prefix="prx-corpus-")
        self.data = os.path.join(self.tmp, "data")
        os.makedirs(self.data)
        self.gen = 0
        src = {f"src/img{k}": (k, 0) for k in range(N_IMAGES)}
        self.main = _write_table(os.path.join(self.data, "photos.lance"), src)
        #: {table path: {id: (image, variant)}}
        self.rows: dict[str, dict[str, tuple[int, int]]] = {self.main: dict(src)}
        #: Opted-out images.
        self.out: set[int] = set()
        #: {export root: {id: image}} as written; at most two kept.
        self.exports: dict[str, dict[str, int]] = {}
        self._export(self.main)

    def teardown(self):
        shutil.rmtree(self.tmp, ignore_errors=True)

    # --- helpers -------------------------------------------------------------------------------

    def _new(self, stem: str) -> str:
        self.gen += 1
        return os.path.join(self.tmp, f"{stem}{self.gen}")

    def _export(self, table: str, ledger: str | None = None, keep: bool = True) -> str:
        from prx_data.pipelines.write_mds import run_export

        from prx_data.core.runtime import RunOptions
        from prx_data.export.spec import ExportConfig

        root = self._new("ex")
        cfg = ExportConfig(table=table, out=root, tiers=(TIER,), ledger=ledger)
        report = run_export(cfg, RunOptions(progress=False))
        rows = self.rows[table]
        want = {i: img for i, (img, _) in rows.items() if img not in self.out}
        # A fresh export writes every row of its table but the opted-out images' rows.
        assert _written(root) == set(want), (table, _written(root), want)
        assert report.dropped.get("opted_out", 0) == len(rows) - len(want)
        if keep:
            self.exports[root] = want
            while len(self.exports) > 2:
                old = next(iter(self.exports))
                del self.exports[old]
                shutil.rmtree(old, ignore_errors=True)
        return root

    def _ledger(self):
        from prx_data.skips.ledger import Ledger

        return Ledger.for_table(self.main)

    # --- rules ---------------------------------------------------------------------------------

    @rule(pick=st.integers(0, 10**6))
    def opt_out(self, pick):
        """``optout --export``: one row of one export; the image leaves with every copy."""
        from prx_data.skips.optout import add_optout

        cand = sorted(
            (root, i)
            for root, ids in self.exports.items()
            for i, img in ids.items()
            if img not in self.out and img != KEPT
        )
        if not cand:
            return
        root, rid = cand[pick % len(cand)]
        add_optout(root, "optout-1", [rid])
        self.out.add(self.exports[root][rid])

    @rule()
    def rebuild(self):
        """The same source ingested again into a new table beside the old one."""
        path = self._new(os.path.join("data", "photos-v"))
        self.rows[_write_table(path + ".lance", self.rows[self.main])] = dict(self.rows[self.main])
        self._export(path + ".lance")

    @rule(source=st.sampled_from(["web", "cam"]))
    def reingest(self, source):
        """The same images under another source name: other ids, same bytes."""
        path = self._new(os.path.join("data", f"{source}-")) + ".lance"
        rows = {f"{source}/{i.split('/', 1)[1]}": v for i, v in self.rows[self.main].items()}
        self.rows[_write_table(path, rows)] = rows
        self._export(path)

    @rule(img=st.integers(0, N_IMAGES - 1), phash_equal=st.booleans())
    def add_copy(self, img, phash_equal):
        """A byte-identical (or re-encoded, pHash-equal) copy under another name."""
        self.gen += 1
        rid = f"copies/{self.gen}"
        variant = 1 if phash_equal else 0
        _append_row(self.main, rid, img, variant)
        self.rows[self.main][rid] = (img, variant)

    @rule()
    def fresh_export(self):
        self._export(self.main)

    @rule()
    def copy_table_alone(self):
        """The table moved without its folder (``--table`` advice): exported naming the ledger."""
        from prx_data.skips.place import default_ledger_uri

        dest = os.path.join(self._new("moved"), "photos.lance")
        shutil.copytree(self.main, dest)
        self.rows[dest] = dict(self.rows[self.main])
        self._export(dest, ledger=default_ledger_uri(self.main))

    @rule()
    def copy_folder_with_ledger(self):
        """The folder copied with its ledger: refused until forked; the fork keeps the opt-outs."""
        from prx_data.skips.errors import ListError
        from prx_data.skips.ledger import Ledger
        from prx_data.skips.place import LEDGER_NAME

        folder = self._new("copy")
        shutil.copytree(self.data, folder)
        copy = os.path.join(folder, "photos.lance")
        if os.path.exists(os.path.join(self.data, LEDGER_NAME)):
            with pytest.raises(ListError, match="two ledgers claim"):
                Ledger.for_table(copy).head()
            Ledger(os.path.join(folder, LEDGER_NAME)).fork()
        else:
            assert not self.out  # no opt-out yet: no ledger yet
        self.rows[copy] = dict(self.rows[self.main])
        self._export(copy, keep=False)  # the fork's opt-outs: ours so far
        del self.rows[copy]
        shutil.rmtree(folder)

    @rule(replace=st.booleans())
    def lose_ledger(self, replace):
        """The ledger deleted (or replaced by another): an error naming it, never "no opt-outs"."""
        from prx_data.skips.errors import ListError
        from prx_data.skips.ledger import Ledger
        from prx_data.skips.ops import sync
        from prx_data.skips.place import default_ledger_uri

        uri = default_ledger_uri(self.main)
        if not os.path.exists(uri) or not self.exports:
            return
        aside = self._new("aside")
        shutil.move(uri, aside)
        try:
            if replace:
                Ledger(uri).append(lambda seq: log_rows_for("other", ["x/0"], seq))
            for root in self.exports:
                with pytest.raises(ListError, match=uri):
                    sync(root)
                self.check_export(root)  # nothing was undone
        finally:
            shutil.rmtree(uri, ignore_errors=True)
            shutil.move(aside, uri)

    @rule()
    def received_export(self):
        """An export received from elsewhere that carries our identity (its ``_lists/registry``
        names our table and ledger) and a crafted export-only log that undoes every opt-out
        and adds a list of every id: ``skips rewrite`` of it writes nothing into our ledger."""
        import pyarrow.parquet as pq

        from prx_data.export import naming
        from prx_data.skips.log import EXPORT_ONLY, conform_entries, log_rows
        from prx_data.skips.rewrite import rewrite_export

        if not self.exports:
            return
        src = next(iter(self.exports))
        recv = self._new("received")
        shutil.copytree(src, recv)
        ids = pa.array(sorted(_written(recv)), pa.string())
        prov = Provenance("crafted")
        evil = pa.concat_tables(
            [
                log_rows(
                    "optout-1",
                    ids,
                    "remove",
                    prov,
                    seq=10**6,
                    base=10**6,
                    kind=EXPORT_ONLY,
                    export=recv,
                ),
                log_rows(
                    "all",
                    ids,
                    "add",
                    prov,
                    seq=10**6 + 1,
                    base=10**6 + 1,
                    kind=EXPORT_ONLY,
                    export=recv,
                ),
            ]
        )
        pq.write_table(
            conform_entries(evil), os.path.join(recv, naming.LISTS_DIR, "_local.parquet")
        )
        led = self._ledger()
        before = (led.head(), len(led.optout_keys()))
        try:
            rewrite_export(recv, self._new("rewritten"), names=["all"], force=True, verify=False)
        except Exception:  # noqa: BLE001 - refusing is fine; writing into our ledger is not
            pass
        led = self._ledger()
        assert (led.head(), len(led.optout_keys())) == before
        assert "all" not in led.state()
        shutil.rmtree(recv)

    @rule()
    def paused_writer(self):
        """A ledger writer paused between its read and its commit while another commits
        (without the lease): its commit is refused by the store and retried at the next
        version; both land once, nothing is lost or doubled."""
        from prx_data.table.lance_ops import append_at_version

        led = self._ledger()
        self.gen += 1
        tag = f"paused/{self.gen}"
        if not led.exists():  # the intruder appends to a ledger that is there
            led.append(lambda seq: log_rows_for("writers", ["paused/first"], seq))
        calls = []

        def make(seq):
            calls.append(seq)
            if len(calls) == 1:  # the pause: an intruder commits at the version we read
                append_at_version(
                    led.uri, log_rows_for("intruders", [tag + "/intruder"], seq), seq - 1
                )
            return log_rows_for("writers", [tag + "/writer"], seq)

        seq = led.append(make)
        assert len(calls) == 2 and seq == calls[1] == calls[0] + 1
        got = led.entries(["intruders", "writers"])
        mine = [i for i in got["id"].to_pylist() if i.startswith(tag + "/")]
        assert sorted(mine) == [tag + "/intruder", tag + "/writer"]

    # --- the check -------------------------------------------------------------------------

    def check_export(self, root: str) -> None:
        want = {i for i, img in self.exports[root].items() if img not in self.out}
        assert _streamed(root) == want, (root, self.out)

    @invariant()
    def every_export_streams_the_model(self):
        from prx_data.skips.ops import sync

        for root in self.exports:
            sync(root)
            self.check_export(root)


def log_rows_for(name: str, ids: list[str], seq: int) -> pa.Table:
    from prx_data.skips.log import conform_entries, log_rows

    return conform_entries(
        log_rows(
            name,
            pa.array(ids, pa.string()),
            "add",
            Provenance("model"),
            seq=seq,
            base=seq,
            kind=0,
            export="",
        )
    )


def _written(root: str) -> set[str]:
    return set(layout.read_manifests(root)["id"].to_pylist())


def _streamed(root: str) -> set[str]:
    from prx_data.stream.dataset import DatasetSpec
    from tests.exportkit import run_rank

    run = run_rank([DatasetSpec(root)], rank=0, world_size=1, batch_size=1, tier=TIER)
    return {i for batch in run.batches for i in batch}


_CORPUS_FAST = settings(
    phases=[Phase.explicit, Phase.reuse, Phase.generate],  # a failure is reported, not shrunk
    max_examples=2,
    stateful_step_count=6,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    derandomize=True,
)
_CORPUS_LONG = settings(
    max_examples=40,
    stateful_step_count=20,
    deadline=None,
    suppress_health_check=list(HealthCheck),
)


@pytest.mark.timeout(300)
def test_corpus_model_short():
    Corpus.TestCase.settings = _CORPUS_FAST
    Corpus.TestCase().runTest()


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_corpus_model_long():
    Corpus.TestCase.settings = _CORPUS_LONG
    Corpus.TestCase().runTest()
