"""``python -m prx_data.planner``: argument parsing over :mod:`prx_data.stream.planner`.

Two ways in: export roots and flags, or ``--config train.yaml [key=value ...]``,
which plans exactly what the run's loader plans (the same ``PlanSpec``, skip
lists and eval hold-out, through ``prx_data.stream.sources.plan_sources``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Sequence

from prx_data.core.errors import PrxDataError
from prx_data.core.flags import add_flags, option_name
from prx_data.stream.planner import (
    DatasetCount,
    Plan,
    PlanError,
    PlanSpec,
    count_export,
    plan_buckets,
)

#: The :class:`PlanSpec` fields with a flag: given without --config only (with it, the
#: YAML and its key=value overrides set the plan).
_PLAN_FIELDS = tuple(f.name for f in dataclasses.fields(PlanSpec) if "cli" in f.metadata)


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
    add_flags(p.add_argument_group("plan (without --config)"), PlanSpec)
    p.set_defaults(**dict.fromkeys(_PLAN_FIELDS))  # None: not given, so --config refuses it
    p.add_argument("--world-size", type=int, default=1, help="number of ranks (default 1)")
    p.add_argument("--nodes", type=int, default=1, help="number of physical nodes (default 1)")
    p.add_argument(
        "--skip-list",
        action="append",
        default=None,
        help="apply only this skip list (repeatable); default all; --no-skips for none",
    )
    p.add_argument("--no-skips", action="store_true", help="apply no skip list")
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
    if args.tier is None or args.device_batch_size is None:
        p.error("--tier and --batch-size are required without --config")
    if args.eval:
        p.error("--eval needs --config")
    spec = PlanSpec(**{f: getattr(args, f) for f in _PLAN_FIELDS if getattr(args, f) is not None})
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

    given = [f for f in _PLAN_FIELDS if getattr(args, f) is not None]
    if given:
        flags = ", ".join(option_name(PlanSpec, f) or f for f in given)
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
