"""``python -m prx_data.explore``: argument parsing over :mod:`prx_data.explore.app`."""

from __future__ import annotations

import argparse
import sys

from prx_data.explore.app import (
    AUTO_DESCRIPTOR_ROWS,
    DEFAULT_HOST,
    DEFAULT_PORT,
    ExploreConfig,
    serve,
)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m prx_data.explore",
        description="Browse a Lance image table in the browser: live caption search, a "
        "thumbnail grid, click an image for visually similar ones, and filters for tier, "
        "aspect-ratio bucket and label columns. Builds missing search indexes at start.",
    )
    p.add_argument("--table", required=True, help="Lance table URI")
    p.add_argument(
        "--host",
        default=DEFAULT_HOST,
        help="address to bind (default: %(default)s, this machine only; use 0.0.0.0 only "
        "on a trusted network: there is no authentication)",
    )
    p.add_argument(
        "--port", type=int, default=DEFAULT_PORT, help="port (default: %(default)s; 0: any free)"
    )
    p.add_argument(
        "--page-size", type=int, default=48, help="thumbnails per query (default: %(default)s)"
    )
    p.add_argument(
        "--descriptors",
        choices=("auto", "yes", "no"),
        default="auto",
        help="compute pixel descriptors for similar-image search when the table has no vector "
        f"column: auto = only if at most {AUTO_DESCRIPTOR_ROWS:,} rows (default), yes, no",
    )
    p.add_argument(
        "--no-index",
        action="store_true",
        help="do not build missing full-text/vector indexes at start (leaves the table unchanged)",
    )
    args = p.parse_args(argv)
    cfg = ExploreConfig(
        table=args.table,
        host=args.host,
        port=args.port,
        page_size=args.page_size,
        descriptors=args.descriptors,
        build_indexes=not args.no_index,
    )
    server = serve(cfg)
    host, port = server.server_address[:2]
    print(f"exploring {cfg.table} at http://{host}:{port}/  (Ctrl-C to stop)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
