"""``python -m prx_data.explore``: argument parsing over :mod:`prx_data.explore.app`."""

from __future__ import annotations

import argparse
import sys

from prx_data.core.errors import PrxDataError
from prx_data.core.flags import add_flags, from_args
from prx_data.explore.app import DEFAULT_PORT, ExploreConfig, serve


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m prx_data.explore",
        description="Browse a Lance image table in the browser: live caption search, a "
        "thumbnail grid, click an image for visually similar ones and its near duplicates side "
        "by side, filters for tier, aspect-ratio bucket and label columns, and a range filter "
        "and sort on any score (numeric column). The table is left unchanged unless "
        "--build-indexes is given; without it the explorer lists what it would build.",
    )
    add_flags(p, ExploreConfig)
    p.set_defaults(port=None)  # not given: DEFAULT_PORT, or any free port with --check
    p.add_argument(
        "--check",
        action="store_true",
        help="start the explorer, load its page and first search results once over loopback, "
        "print what came back and exit (0 when both answered): a smoke test, e.g. offline",
    )
    # Deprecated: leaving the table unchanged is now the default.
    p.add_argument("--no-index", action="store_true", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if args.no_index:
        print(
            "note: --no-index is deprecated and does nothing: the table is left unchanged "
            "unless --build-indexes is given",
            file=sys.stderr,
        )
        if args.build_indexes:
            p.error("--no-index and --build-indexes contradict each other; drop --no-index")
    try:
        port = args.port if args.port is not None else (0 if args.check else DEFAULT_PORT)
        cfg = from_args(ExploreConfig, args, port=port)
    except PrxDataError as e:
        p.error(str(e))
    try:
        server = serve(cfg)
    except PrxDataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    host, port = server.server_address[:2]
    if args.check:
        return _check(server)
    print(f"exploring {cfg.table} at http://{host}:{port}/  (Ctrl-C to stop)", flush=True)
    if host in ("0.0.0.0", "::") and not cfg.allowed_hosts:
        print(
            f"note: bound to {host}, but only loopback Host names are served; add "
            "--allow-host NAME for the name other machines use to reach this one",
            flush=True,
        )
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


def _check(server) -> int:
    """Serve two requests from a thread (the page, the first search page), then stop."""
    import json
    import threading
    import urllib.request

    port = server.server_address[1]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        base = f"http://127.0.0.1:{port}"
        with urllib.request.urlopen(base + "/", timeout=60) as r:
            page = r.status == 200 and b"<html" in r.read(4096).lower()
        with urllib.request.urlopen(base + "/api/search", timeout=120) as r:
            found = json.loads(r.read())
    except OSError as e:
        print(f"error: the explorer did not answer: {e}", file=sys.stderr)
        return 1
    finally:
        server.shutdown()
        server.server_close()
    rows = found.get("rows") or found.get("results") or []
    print(
        f"explorer ok: page {'served' if page else 'MISSING'}, {len(rows)} rows on the first page"
    )
    return 0 if page else 1


if __name__ == "__main__":
    sys.exit(main())
