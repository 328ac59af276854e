"""``python -m prx_data.jpeg_fidelity``: argument parsing over :mod:`prx_data.export.fidelity`."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from prx_data.core.imaging import DEFAULT_JPEG_QUALITY, ImageError
from prx_data.export.fidelity import FidelityConfig, estimate_quality, run_fidelity


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m prx_data.jpeg_fidelity",
        description="Measure what JPEG re-encoding costs on your images (PSNR, and LPIPS when the "
        "lpips package is installed, per resolution band, after 1 and 10 encode/decode cycles), "
        "or estimate the quality JPEG files were saved at.",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--folder", help="Folder of images (searched recursively).")
    src.add_argument("--table", help="Lance table URI; samples are drawn from its image column.")
    src.add_argument(
        "--estimate-quality",
        nargs="+",
        metavar="FILE",
        help="Print the estimated JPEG quality of these files (libjpeg table match) and exit.",
    )
    p.add_argument(
        "--quality",
        type=int,
        default=DEFAULT_JPEG_QUALITY,
        help="JPEG quality to re-encode at (default: %(default)s, the exporter's).",
    )
    p.add_argument(
        "--cycles",
        type=int,
        nargs="+",
        default=[1, 10],
        help="Numbers of encode/decode cycles to report (default: 1 10).",
    )
    p.add_argument(
        "--subsampling",
        type=int,
        choices=[-1, 0, 1, 2],
        default=-1,
        help="Chroma subsampling as for write_mds: -1 Pillow default (4:2:0), 0 = 4:4:4, "
        "1 = 4:2:2, 2 = 4:2:0 (default: %(default)s).",
    )
    p.add_argument(
        "--limit", type=int, default=100, help="Images to sample (default: %(default)s)."
    )
    p.add_argument("--seed", type=int, default=0, help="Sampling seed (default: %(default)s).")
    p.add_argument(
        "--no-lpips",
        dest="lpips",
        action="store_const",
        const="off",
        default="auto",
        help="Skip LPIPS even when the lpips package is installed.",
    )
    p.add_argument("--json", default=None, help="Also write the report as JSON to this path.")
    p.add_argument(
        "--no-progress", dest="progress", action="store_false", help="Hide the progress bar."
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.estimate_quality:
        rows = []
        for path in args.estimate_quality:
            try:
                est = estimate_quality(path)
                rows.append({"file": path, **asdict(est)})
                tag = "" if est.exact else f" (nearest; tables differ by {est.distance} per entry)"
                print(f"{path}: q{est.quality}{tag}")
            except (ImageError, OSError) as e:
                rows.append({"file": path, "error": str(e)})
                print(f"{path}: {e}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=2)
        return 0
    from prx_data.table.lance_ops import lance_storage_options

    cfg = FidelityConfig(
        folder=args.folder,
        table=args.table,
        quality=args.quality,
        cycles=tuple(args.cycles),
        subsampling=args.subsampling,
        limit=args.limit,
        seed=args.seed,
        lpips=args.lpips,
        storage_options=lance_storage_options(args.table) if args.table else None,
        progress=args.progress,
    )
    report = run_fidelity(cfg)
    print(report.text())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report.to_dict(), f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
