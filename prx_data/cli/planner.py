"""``python -m prx_data.planner``: argument parsing over :mod:`prx_data.stream.planner`.

Two ways in: export roots and flags, or ``--config train.yaml [key=value ...]``,
which plans exactly what the run's loader plans (the same ``PlanSpec``, skip
lists and eval hold-out, through ``prx_data.stream.sources.plan_sources``).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence

from prx_data.core.errors import PrxDataError
from prx_data.stream.planner import (
    BATCHING_METHODS,
    DatasetCount,
    Plan,
    PlanError,
    PlanSpec,
    count_export,
    plan_buckets,
)

#: Flags that set the plan; with --config the YAML (and its overrides) set it instead.
_PLAN_FLAGS = (
    "tier",
    "include_higher_tiers",
    "batch_size",
    "workers",
    "canonical_nodes",
    "replication",
    "batching",
    "epoch_size",
    "skip_list",
    "no_skips",
    "small_buckets",
)


def _parse_dataset(arg: str) -> tuple[str, float | None]:
    root, sep, weight = arg.rpartition("=")
    if sep and root and not weight.startswith("/"):
        try:
            return root, float(weight)
        except ValueError:
            pass
    return arg, None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m prx_data.planner",
        description="Preflight a bucketed streaming run: requested vs realised share per "
        "dataset; per bucket samples after skips, planned samples, batches and dropped "
        "samples; exits 2 on configurations streaming would crash on.",
    )
    p.add_argument(
        "datasets",
        nargs="*",
        help="export roots (local or s3://); append =P for a mixing proportion, e.g. a/=0.7 "
        "b/=0.3. With --config: key=value overrides of the train config instead",
    )
    p.add_argument(
        "--config",
        default=None,
        metavar="YAML",
        help="plan exactly what this train config's run streams (data: section, skip lists and "
        "eval hold-out); the world comes from --world-size/--nodes",
    )
    p.add_argument(
        "--eval",
        action="store_true",
        help="with --config: plan the eval stream instead of the training one",
    )
    p.add_argument(
        "--tier",
        type=int,
        default=None,
        help="training resolution tier, e.g. 512 (also the tier of a tree with one folder per "
        "aspect ratio that was not adopted)",
    )
    p.add_argument("--include-higher-tiers", action="store_true", help="also stream higher tiers")
    p.add_argument("--batch-size", type=int, default=None, help="device (per-rank) batch size")
    p.add_argument("--world-size", type=int, default=1, help="number of ranks (default 1)")
    p.add_argument("--nodes", type=int, default=1, help="number of physical nodes (default 1)")
    p.add_argument(
        "--workers", type=int, default=None, help="DataLoader workers per rank (default 1)"
    )
    p.add_argument(
        "--canonical-nodes", type=int, default=None, help="num_canonical_nodes (default: nodes)"
    )
    p.add_argument("--replication", type=int, default=None, help="ranks per replica group")
    p.add_argument("--batching", default=None, choices=BATCHING_METHODS, help="batching method")
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
        default=None,
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
    return p


def main(argv: Sequence[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    try:
        plan = _from_config(p, args) if args.config else _from_flags(p, args)
    except PrxDataError as e:
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


def _from_flags(p, args) -> Plan:
    if not args.datasets:
        p.error("give export roots, or --config train.yaml")
    if args.tier is None or args.batch_size is None:
        p.error("--tier and --batch-size are required without --config")
    if args.eval:
        p.error("--eval needs --config")
    spec = PlanSpec(
        tier=args.tier,
        device_batch_size=args.batch_size,
        include_higher_tiers=args.include_higher_tiers,
        batching_method=args.batching or "per_stream",
        num_workers=args.workers if args.workers is not None else 1,
        num_canonical_nodes=args.canonical_nodes,
        replication=args.replication,
        epoch_size=args.epoch_size,
        small_buckets=args.small_buckets or "error",
    )
    names = [] if args.no_skips else args.skip_list
    counts = []
    from prx_data.export.adopt import resolve_tree

    for arg in args.datasets:
        root, prop = _parse_dataset(arg)
        root = resolve_tree(
            root, args.tier
        )  # one folder per aspect ratio, not adopted: the run's tier
        counts.append(DatasetCount(root, count_export(root, spec.tiers(), names), proportion=prop))
    return plan_buckets(counts, spec, world_size=args.world_size, num_nodes=args.nodes)


def _from_config(p, args) -> Plan:
    """The run's own plan: its PlanSpec, datasets, skip lists and hold-out, via plan_sources."""
    from prx_data.stream.sources import plan_sources
    from prx_data.train.config import device_batch_size, load_config
    from prx_data.train.data import dataset_specs
    from prx_data.train.evaluation import eval_data_config, holdout_for

    given = [f for f in _PLAN_FLAGS if getattr(args, f) not in (None, False)]
    if given:
        flags = ", ".join("--" + f.replace("_", "-") for f in given)
        p.error(f"{flags}: with --config, set these in the YAML or as key=value overrides")
    bad = [o for o in args.datasets if "=" not in o]
    if bad:
        p.error(f"with --config, positional arguments are key=value overrides, got {bad}")
    cfg = load_config(args.config, args.datasets)
    world = args.world_size
    data = eval_data_config(cfg, world) if args.eval else cfg.data
    if data.factory:
        raise PlanError("data.factory builds its own dataset: there is no bucket plan to preview")
    batch = device_batch_size(data, world)
    holdout = holdout_for(cfg, "eval" if args.eval else "train")
    _, plan = plan_sources(
        dataset_specs(data, holdout),
        data.plan_spec(batch),
        world_size=world,
        num_nodes=args.nodes,
        caption_columns=tuple(dict.fromkeys(c.name for c in data.caption_columns)),
    )
    return plan


if __name__ == "__main__":
    raise SystemExit(main())
