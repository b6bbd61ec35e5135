"""`python -m pipeline.dashboard RUN_DIR [--serve] [--port N]`"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pipeline.dashboard import write_report
from pipeline.data.storage import is_uri


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipeline.dashboard",
                                     description="Write RUN_DIR/report.html, or serve it live.")
    parser.add_argument("run_dir", help="a run directory (output.dir of a run: a path or a URI)")
    parser.add_argument("--serve", action="store_true",
                        help="serve the report on 127.0.0.1, refreshed as shards commit")
    parser.add_argument("--port", type=int, default=8600, help="port for --serve (0: any free port)")
    parser.add_argument("--poll", type=float, default=3.0,
                        help="seconds between the page's checks for new shards (--serve)")
    args = parser.parse_args(argv)
    if is_uri(args.run_dir) and args.serve:
        print("error: --serve needs a local run directory", file=sys.stderr)
        return 2
    if not is_uri(args.run_dir) and not Path(args.run_dir).is_dir():
        print(f"error: {args.run_dir} is not a directory", file=sys.stderr)
        return 2
    path = write_report(args.run_dir)
    print(f"wrote {path}", file=sys.stderr)
    if args.serve:
        from pipeline.dashboard.serve import serve_forever

        serve_forever(args.run_dir, args.port, args.poll)
    return 0


if __name__ == "__main__":
    sys.exit(main())
