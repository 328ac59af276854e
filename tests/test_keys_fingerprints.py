"""The key set's fingerprints are computed over whole columns (no per-row numpy writes); they
must equal, bit for bit, the row-by-row definition that exports already wrote key sets with."""

from __future__ import annotations

import hashlib

import numpy as np
import pyarrow as pa
import pytest

from prx_data.core import keys as K

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


def _ref_ids(ids):
    out, valid = np.zeros(len(ids), np.uint64), np.zeros(len(ids), bool)
    for i, v in enumerate(ids):
        if v:
            out[i] = int.from_bytes(hashlib.blake2b(v.encode(), digest_size=8).digest(), "big")
            valid[i] = True
    return out, valid


def _ref_digests(digests):
    out, valid = np.zeros(len(digests), np.uint64), np.zeros(len(digests), bool)
    for i, v in enumerate(digests):
        if v and len(v) == 64:
            try:
                out[i] = int(v[:16], 16)
            except ValueError:
                continue
            valid[i] = True
    return out, valid


def _ref_phashes(phashes):
    out, valid = np.zeros(len(phashes), np.uint64), np.zeros(len(phashes), bool)
    for i, v in enumerate(phashes):
        if v is None:
            continue
        u = int(v) & ((1 << 64) - 1)
        if u in K.DEGENERATE_PHASHES:
            continue
        out[i], valid[i] = u, True
    return out, valid


def _same(got, want):
    fp, ok = got
    rfp, rok = want
    assert ok.tolist() == rok.tolist()
    assert fp[ok].tolist() == rfp[rok].tolist()


hexdigest = st.binary(min_size=32, max_size=32).map(lambda b: b.hex())
digest = st.one_of(
    st.none(),
    hexdigest,
    hexdigest.map(str.upper),
    st.just(""),
    st.just("0x" + "f" * 62),  # Python's int() takes a 0x prefix
    st.just("_".join(["ab"] * 21) + "a"),  # and underscores
    st.just("é" * 64),
    st.just("g" * 64),
    st.text(max_size=70),
)
phash = st.one_of(
    st.none(),
    st.integers(-(2**63), 2**63 - 1),
    st.sampled_from([0, -1, 2**63 - 1, -(2**63)]),
)


@settings(max_examples=60, deadline=None)
@given(ids=st.lists(st.one_of(st.none(), st.text(max_size=12)), max_size=30))
def test_id_fingerprints_equal_the_row_by_row_definition(ids):
    _same(K._id_fingerprints(ids), _ref_ids(ids))
    _same(K._id_fingerprints(pa.array(ids, pa.string())), _ref_ids(ids))


@settings(max_examples=60, deadline=None)
@given(digests=st.lists(digest, max_size=30), cut=st.integers(0, 5))
def test_digest_fingerprints_equal_the_row_by_row_definition(digests, cut):
    _same(K._digest_fingerprints(digests), _ref_digests(digests))
    sliced = pa.chunked_array([pa.array(digests, pa.string())]).combine_chunks()[cut:]
    _same(K._digest_fingerprints(sliced), _ref_digests(digests[cut:]))


@settings(max_examples=60, deadline=None)
@given(phashes=st.lists(phash, max_size=30))
def test_phash_fingerprints_equal_the_row_by_row_definition(phashes):
    _same(K._phash_fingerprints(phashes), _ref_phashes(phashes))
    _same(K._phash_fingerprints(pa.array(phashes, pa.int64())), _ref_phashes(phashes))
    unsigned = [None if v is None else v & ((1 << 64) - 1) for v in phashes]
    _same(K._phash_fingerprints(unsigned), _ref_phashes(unsigned))


def test_a_key_set_of_columns_equals_one_of_lists():
    rng = np.random.default_rng(3)
    ids = [f"x/{i}" for i in range(2000)] + [None, ""]
    digests = [rng.bytes(32).hex() for _ in range(2000)] + [None, "zz"]
    ph = [int(v) for v in rng.integers(-(2**63), 2**63 - 1, 2000)] + [None, 0]
    a = K.KeySet.of(ids, digests, ph)
    b = K.KeySet.of(pa.array(ids), pa.array(digests), pa.array(ph, pa.int64()))
    refs = {"id": _ref_ids(ids), "sha256": _ref_digests(digests), "phash": _ref_phashes(ph)}
    for kind in K.KINDS:
        fp, ok = refs[kind]
        assert (
            getattr(a, kind).tolist() == getattr(b, kind).tolist() == sorted(set(fp[ok].tolist()))
        )
    assert a.matches(pa.array(ids[:5]), pa.array(digests[:5]), pa.array(ph[:5], pa.int64())).all()
