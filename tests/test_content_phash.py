"""An opt-out follows a pHash whose top bit is set.

Dedup stores pHashes as uint64, so half of them are above 2**63; looking
them up by Python ints made Arrow infer int64 and overflow ("Python int too
large to convert to C long"), and `optout` on the demo export crashed after
`dedup` had run. Tables that stored them signed are looked up by the same bits.
"""

from __future__ import annotations

import lance
import pyarrow as pa
import pytest

from prx_data.core import schema as S
from prx_data.skips.content import expand

HIGH = (1 << 63) + 12345  # a pHash with the top bit set


@pytest.mark.parametrize("typ", [pa.uint64(), pa.int64()])
def test_a_phash_above_2_63_finds_its_copies(tmp_path, typ):
    stored = HIGH if typ == pa.uint64() else HIGH - (1 << 64)
    uri = str(tmp_path / "t.lance")
    table = pa.table(
        {
            S.ID: ["a", "b", "c"],
            S.SHA256: ["1" * 64, "2" * 64, "3" * 64],
            S.PHASH: pa.array([stored, stored, 7], typ),
        }
    )
    lance.write_dataset(table, uri)
    found = expand([uri], ["a"])
    assert found.added["phash"] == ["b"]
