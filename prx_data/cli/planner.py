"""``python -m prx_data.planner``: argument parsing over :mod:`prx_data.stream.planner`."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence

from prx_data.stream.planner import (
    BATCHING_METHODS,
    DatasetCount,
    PlanError,
    count_export,
    plan_buckets,
)


def _parse_dataset(arg: str) -> tuple[str, float | None]:
    root, sep, weight = arg.rpartition("=")
    if sep and root and not weight.startswith("/"):
        try:
            return root, float(weight)
        except ValueError:
            pass
    return arg, None


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    from prx_data.core.buckets import DEFAULT_SPEC
    from prx_data.core.errors import PrxDataError
    from prx_data.export.adopt import declare_if_flat

    p = argparse.ArgumentParser(
        prog="python -m prx_data.planner",
        description="Preflight a bucketed streaming run: requested vs realised share per "
        "dataset; per bucket samples after skips, planned samples, batches and dropped "
        "samples; exits 2 on configurations streaming would crash on.",
    )
    p.add_argument(
        "datasets",
        nargs="+",
        help="export roots (local or s3://); append =P for a mixing proportion, e.g. a/=0.7 b/=0.3",
    )
    p.add_argument(
        "--tier",
        type=int,
        required=True,
        help="training resolution tier, e.g. 512 (also the tier of a tree with one folder per "
        "aspect ratio that was not adopted)",
    )
    p.add_argument("--include-higher-tiers", action="store_true", help="also stream higher tiers")
    p.add_argument("--batch-size", type=int, required=True, help="device (per-rank) batch size")
    p.add_argument("--world-size", type=int, default=1, help="number of ranks (default 1)")
    p.add_argument("--nodes", type=int, default=1, help="number of physical nodes (default 1)")
    p.add_argument("--workers", type=int, default=1, help="DataLoader workers per rank (default 1)")
    p.add_argument(
        "--canonical-nodes", type=int, default=None, help="num_canonical_nodes (default: nodes)"
    )
    p.add_argument("--replication", type=int, default=None, help="ranks per replica group")
    p.add_argument(
        "--batching", default="per_stream", choices=BATCHING_METHODS, help="batching method"
    )
    p.add_argument(
        "--epoch-size", type=int, default=None, help="samples per epoch (with proportions)"
    )
    p.add_argument(
        "--skip-list",
        action="append",
        default=None,
        help="apply only this skip list (repeatable); default all; --no-skips for none",
    )
    p.add_argument("--no-skips", action="store_true", help="apply no skip list")
    p.add_argument(
        "--small-buckets",
        default="error",
        choices=("error", "drop"),
        help="buckets too small for a unit: fail (default) or leave out with a warning",
    )
    p.add_argument(
        "--json",
        default=None,
        metavar="PATH",
        help="also write the whole plan as JSON to PATH ('-' for stdout instead of the table): "
        "per dataset requested/realised share and samples, per bucket samples/skipped/"
        "planned/dropped, epoch size and unit",
    )
    args = p.parse_args(argv)
    tiers = [
        t
        for t in DEFAULT_SPEC.tiers
        if t == args.tier or (args.include_higher_tiers and t > args.tier)
    ]
    names = [] if args.no_skips else args.skip_list
    counts = []
    try:
        for arg in args.datasets:
            root, prop = _parse_dataset(arg)
            # A tree of one folder per aspect ratio, not adopted: its tier is the run's.
            declare_if_flat(root, args.tier)
            counts.append(DatasetCount(root, count_export(root, tiers, names), proportion=prop))
    except (PrxDataError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        plan = plan_buckets(
            counts,
            device_batch_size=args.batch_size,
            world_size=args.world_size,
            num_nodes=args.nodes,
            num_workers=args.workers,
            num_canonical_nodes=args.canonical_nodes,
            replication=args.replication,
            batching_method=args.batching,
            epoch_size=args.epoch_size,
            small_buckets=args.small_buckets,
        )
    except PlanError as e:
        print(f"error: {e}")
        return 2
    if args.json == "-":
        print(json.dumps(plan.to_dict(), indent=2))
    else:
        print(plan.report())
    if args.json and args.json != "-":
        with open(args.json, "w") as f:
            json.dump(plan.to_dict(), f, indent=2)
    return 2 if plan.problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
