"""Model-based test of the skip-list log (``hypothesis`` stateful testing).

The model: the registry's state (list -> ids), each export's own
(export-only) overrides, and what each export showed when it was last
materialised. An export-only change of an id holds in its export until a
later registry change of that id; a registry change clears every export's
override of that id (it is newer). Any operation on an export, and ``sync``,
materialises it fully; other exports keep what they showed until theirs.

After every step, for every export, the ids its sidecars skip (the loader's
view, through its manifests) and the ids its ``_lists/`` store holds equal
the model. Writers' clocks are skewed at random: the order is commit order.
The short profile runs in the default suite; the long one is marked slow.
"""

from __future__ import annotations

import datetime as dt
import os
import shutil
import tempfile

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule  # noqa: E402

from prx_data.skips import lists as L  # noqa: E402
from tests.exportkit import make_export  # noqa: E402
from tests.tablekit import make_table  # noqa: E402

B = "512/1.000"
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
            L.sync(root, self.table)
            self.ex[e] = root
        self.where = TEMPLATE.where
        self.reg: dict[str, set[str]] = {}
        self.over: dict[str, dict[tuple[str, str], str]] = {e: {} for e in EXPORTS}
        self.shown: dict[str, dict[str, set[str]]] = {e: {} for e in EXPORTS}
        self.skew = 0.0
        self.gen = 0

    def teardown(self):
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

    def prov(self) -> L.Provenance:
        return L.Provenance("model", at=dt.datetime.now(dt.UTC) + dt.timedelta(seconds=self.skew))

    # --- rules ---------------------------------------------------------------------------------

    @rule(delta=st.sampled_from([-3600.0, -60.0, 0.0, 60.0, 86400.0]))
    def skew_clock(self, delta):
        self.skew = delta

    @rule(e=st.sampled_from(EXPORTS), n=st.sampled_from(LISTS), ids=ids_st, only=st.booleans())
    def add(self, e, n, ids, only):
        L.update_list(self.ex[e], n, sorted(ids), self.prov(), export_only=only)
        if only:
            self.over[e].update({(n, i): "add" for i in ids})
        else:
            self.reg_op(n, ids, "add")
        self.shown[e] = self.view(e)

    @rule(e=st.sampled_from(EXPORTS), n=st.sampled_from(LISTS), ids=ids_st, only=st.booleans())
    def remove_ids(self, e, n, ids, only):
        L.update_list(self.ex[e], n, sorted(ids), self.prov(), mode="remove", export_only=only)
        if only:
            self.over[e].update({(n, i): "remove" for i in ids})
        else:
            self.reg_op(n, ids, "remove")
        self.shown[e] = self.view(e)

    @rule(e=st.sampled_from(EXPORTS), n=st.sampled_from(LISTS), only=st.booleans())
    def remove_list(self, e, n, only):
        held = set(self.view(e).get(n, set()))
        L.update_list(self.ex[e], n, None, self.prov(), mode="remove", export_only=only)
        if only:
            self.over[e].update({(n, i): "remove" for i in held})
        else:
            self.reg_op(n, held, "remove")
        self.shown[e] = self.view(e)

    @rule(e=st.sampled_from(EXPORTS))
    def sync(self, e):
        L.sync(self.ex[e])
        self.shown[e] = self.view(e)

    @rule(e=st.sampled_from(EXPORTS))
    def overwrite(self, e):
        """``write_mds --overwrite``: carry the old tree's entries, a new tree, materialise."""
        reg = L.Registry.for_table(self.table)
        L.carry(self.ex[e], reg)
        for (n, i), op in sorted(self.over[e].items()):
            self.reg_op(n, {i}, op)
        self.gen += 1
        root = os.path.join(self.tmp, f"{e}.{self.gen}")
        shutil.copytree(TEMPLATE.root, root)
        shutil.rmtree(self.ex[e])
        self.ex[e] = root
        with L.export_lease(root) as lease:
            L.materialise(root, reg, lease, full=True)
        self.shown[e] = self.view(e)

    # --- the check -------------------------------------------------------------------------

    @invariant()
    def exports_equal_the_model(self):
        from tests.test_list_model import skipped, stored

        held = set(self.where)
        for e in EXPORTS:
            want = self.shown[e]
            assert stored(self.ex[e]) == want, e
            got = skipped(TEMPLATE, self.ex[e])
            assert got == {n: v & held for n, v in want.items() if v & held}, e


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
    max_examples=6,
    stateful_step_count=8,
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
