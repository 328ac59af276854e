"""``python -m prx_data.attach``: argument parsing over :mod:`prx_data.pipelines.attach`."""

from __future__ import annotations

import argparse
import dataclasses
import sys

from prx_data.cli.reporting import add_report_args, run_job
from prx_data.core.flags import add_flags, option_name
from prx_data.pipelines.attach import AttachConfig, run_attach


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m prx_data.attach",
        description="Attach table columns (new captions, scores, labels) to an export without "
        "rewriting its shards: each column is joined by id through the export's id manifests "
        "and stored beside the shards (OUT/_columns/<name>/, one Arrow file per shard, bound "
        "to the shard's content). The loader serves them as extra_columns or caption columns, "
        "from local and s3:// or gs:// exports. A rerun computes only shards that lack a "
        "current file (new or changed shards); an id the table lacks gives a null, counted. "
        "With --text-encoder, caption columns are stored as the encoder's embeddings and "
        "attention masks (latent_<caption>_<encoder>, attention_mask_<caption>_<encoder>) for "
        "the trainer's text_encoder.source: precomputed. VAE latents are the attached column "
        "img_latent (extra_columns: [img_latent]; vae.source: precomputed): "
        "'python -m prx_data.attach OUT --vae VAE [options]' runs python -m prx_data.latents "
        "OUT --vae VAE [options], its producer (see its --help for the options).",
    )
    add_flags(p, AttachConfig)
    add_report_args(p)
    return p


def _options(cls) -> set[str]:
    """The long options that set a job config's own fields (not those of configs it nests)."""
    return {o for f in dataclasses.fields(cls) if (o := option_name(cls, f.name))}


def _makes_latents(argv: list[str]) -> bool:
    return any(a == "--vae" or a.startswith("--vae=") for a in argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if _makes_latents(argv):  # the img_latent column's producer: the latents job, as it is
        from prx_data.pipelines.latents import LatentsConfig

        own = _options(AttachConfig) - _options(LatentsConfig)
        given = sorted({a.split("=", 1)[0] for a in argv} & own)
        if given:
            build_parser().error(
                f"--vae makes the img_latent column (python -m prx_data.latents); it takes "
                f"the latents job's options, not {', '.join(given)}: run them separately"
            )
        from prx_data.cli import latents

        return latents.main(argv)
    return run_job(
        build_parser().parse_args(argv),
        AttachConfig,
        run_attach,
        footer=lambda cfg: f"columns: {cfg.out}/_columns/",
    )


if __name__ == "__main__":
    sys.exit(main())
