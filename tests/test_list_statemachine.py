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
from hypothesis import HealthCheck, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule  # noqa: E402

from prx_data.export import layout  # noqa: E402
from prx_data.skips import sidecar as SL  # noqa: E402
from prx_data.skips.bind import ids_at  # noqa: E402
from prx_data.skips.export_state import export_lease  # noqa: E402
from prx_data.skips.ledger import Ledger, read_table_id, registry_uri  # noqa: E402
from prx_data.skips.log import Provenance  # noqa: E402
from prx_data.skips.materialise import materialise  # noqa: E402
from prx_data.skips.ops import carry, sync, update_list  # noqa: E402
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
