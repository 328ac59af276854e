"""One soak worker (``python -m tests.listsoak SEED OPS TABLE OUT EXPORT...``): random list
updates (opt-outs with content keys) and syncs on the exports of one table, each acknowledged op written to OUT as JSON
lines ``{"seq", "list", "op", "ids"}`` (seq: the registry commit that recorded it)."""

from __future__ import annotations

import json
import random
import sys

import pyarrow as pa

from prx_data.core.keys import sha256_hex
from prx_data.skips.log import Provenance
from prx_data.skips.ops import sync, update_list

B = "512/1.000"


def content_keys(ids: list[str]) -> pa.Table:
    """The soak's stand-in content keys of ``ids``: a digest derived from the id."""
    return pa.table(
        {
            "id": pa.array(ids, pa.string()),
            "sha256": pa.array([sha256_hex(i.encode()) for i in ids], pa.string()),
            "phash": pa.nulls(len(ids), pa.int64()),
        }
    )


def main(argv: list[str]) -> int:
    seed, ops, table, out, *exports = argv
    rng = random.Random(int(seed))
    ids = [f"ds/{B}/{i}" for i in range(10)]
    with open(out, "w") as f:
        for _ in range(int(ops)):
            root = rng.choice(exports)
            what = rng.random()
            if what < 0.2:
                sync(root)
                continue
            name = rng.choice(["optout", "dedup"])
            chosen = sorted(rng.sample(ids, rng.randint(1, 3)))
            op = "add" if what < 0.65 else "remove"
            # An opt-out carries its rows' content keys, as ``optout`` records them.
            keys = content_keys(chosen) if name == "optout" and op == "add" else None
            r = update_list(root, name, chosen, Provenance(f"soak {seed}"), mode=op, keys=keys)
            f.write(
                json.dumps(
                    {"seq": r.registry_changes["seq"], "list": name, "op": op, "ids": chosen}
                )
                + "\n"
            )
            f.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
