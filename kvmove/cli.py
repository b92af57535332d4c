"""The ``kvmove`` command: ``kvmove demo``, ``kvmove tune``."""

from __future__ import annotations

import argparse
import logging
import os
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="kvmove", description="Move KV-cache bytes.")
    parser.add_argument("-v", "--verbose", action="count", default=0)
    sub = parser.add_subparsers(dest="command", required=True)
    from kvmove import demo

    demo.build_parser(sub.add_parser("demo", help="simulated HiSparse decode loop, verified"))
    sub.add_parser("tune", help="autotune the Triton kernels for this GPU", add_help=False)
    args, rest = parser.parse_known_args(argv)
    # Mooncake's own (glog) logging: errors only, unless -v; an explicit setting wins.
    os.environ.setdefault("MC_LOG_LEVEL", "INFO" if args.verbose else "ERROR")
    logging.basicConfig(level=logging.WARNING - 10 * args.verbose,
                        format="%(levelname)s %(name)s: %(message)s")
    if args.command == "tune":
        from kvmove.tuning.command import tune_main

        return tune_main(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    return demo.run_main(args)


if __name__ == "__main__":
    sys.exit(main())
