"""``python -m prx_data.latents``: argument parsing over :mod:`prx_data.pipelines.latents`."""

from __future__ import annotations

import argparse
import sys

from prx_data.cli.reporting import add_report_args, run_job
from prx_data.core.flags import add_flags
from prx_data.pipelines.latents import LatentsConfig, run_latents


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m prx_data.latents",
        description="Encode every image of an export with a VAE once and store the latents "
        "beside its shards (OUT/_latents/, one .npy per shard, and record.json), so a "
        "latent-space training run with vae.source: precomputed reads them instead of running "
        "the encoder every step. The shards are not rewritten; a rerun encodes only the shards "
        "whose latents are missing or changed. Small work runs on threads of this process; on "
        "Ray (larger work, or a cluster) it starts Ray first, to give each GPU one encoder.",
    )
    add_flags(p, LatentsConfig)
    add_report_args(p)
    return p


def main(argv: list[str] | None = None) -> int:
    return run_job(
        build_parser().parse_args(argv),
        LatentsConfig,
        run_latents,
        footer=lambda cfg: f"record: {cfg.out}/_latents/record.json",
    )


if __name__ == "__main__":
    sys.exit(main())
