"""The ``kvmove`` command: ``demo``, ``master``, ``doctor``, ``tune``.

Building the parser imports no torch (``kvmove --help`` is fast): each subcommand's module
is imported only when it runs. ``-v`` works before or after the subcommand.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

COMMANDS = {
    "demo": "simulated HiSparse decode loop through a real Mooncake store, every byte "
            "verified (--processes 2: the prefill/decode shape)",
    "master": "run a standalone Mooncake master for a cluster, in the foreground",
    "doctor": "report what kvmove needs on this machine (GPU, torch, Triton, Mooncake, "
              "libibverbs, memlock, tuned tables, the master) and what blocks use",
    "tune": "autotune the Triton kernels for this GPU (kvmove tune --help)",
}


class _Parser(argparse.ArgumentParser):
    """Bad values end in one line naming the option (and where help is), exit 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _verbose(parser: argparse.ArgumentParser, default) -> None:
    parser.add_argument("-v", "--verbose", action="count", default=default,
                        help="more log output; -v also shows Mooncake's own log (repeatable)")


def build_parser() -> argparse.ArgumentParser:
    from kvmove.cli import demo_options, doctor
    from kvmove.cli import master as master_command

    parser = _Parser(prog="kvmove", description="Move KV-cache bytes between "
                                     "a GPU KV cache, pinned staging and a Mooncake store.")
    _verbose(parser, 0)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                parser_class=_Parser)
    parsers = {name: sub.add_parser(name, help=text, description=text)
               for name, text in COMMANDS.items() if name != "tune"}
    parsers["tune"] = sub.add_parser("tune", help=COMMANDS["tune"], add_help=False)
    for p in parsers.values():
        _verbose(p, argparse.SUPPRESS)  # the subcommand's -v adds to the top-level count
    demo_options.build_parser(parsers["demo"])
    master_command.build_parser(parsers["master"])
    doctor.build_parser(parsers["doctor"])
    return parser


def parse(argv) -> tuple[argparse.Namespace, list[str], argparse.ArgumentParser]:
    """``(args, rest, subcommand's parser)``; ``args.verbose`` counts ``-v`` before and
    after the subcommand; ``rest`` is what ``tune`` parses itself."""
    argv = list(argv)
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    at = argv.index(args.command)
    before = sum(a in ("-v", "--verbose") for a in argv[:at])
    after = sum(a in ("-v", "--verbose") for a in argv[at + 1:])
    args.verbose = before + after
    if args.command == "tune":
        rest = [a for a in rest if a not in ("-v", "--verbose")]
    elif rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    subparser = parser._subparsers._group_actions[0].choices[args.command]
    return args, rest, subparser


def main(argv=None) -> int:
    args, rest, subparser = parse(sys.argv[1:] if argv is None else argv)
    # Mooncake's own (glog) logging: errors only, unless -v; an explicit setting wins.
    os.environ.setdefault("MC_LOG_LEVEL", "INFO" if args.verbose else "ERROR")
    logging.basicConfig(level=logging.WARNING - 10 * args.verbose,
                        format="%(levelname)s %(name)s: %(message)s")
    if args.command != "demo" or args.verbose:
        return run(args, rest, subparser)
    # The demo keeps Mooncake's native log lines out of the terminal: in a file that is
    # removed after a good run and named after a failed one.
    from kvmove.store.native_log import native_stderr_to

    code = 1
    with native_stderr_to("kvmove-demo-mooncake-") as native_log:
        try:
            code = run(args, rest, subparser)
        finally:
            if code == 0 or os.path.getsize(native_log) == 0:
                os.unlink(native_log)
            else:
                print(f"kvmove demo: Mooncake's own log of this run: {native_log}",
                      file=sys.stderr)
    return code


def run(args, rest, subparser) -> int:
    if args.command == "tune":
        from kvmove.cli.tune import tune_main

        return tune_main(rest)
    if args.command == "master":
        from kvmove.cli import master as master_command

        master_command.check_args(subparser, args)
        return master_command.run_main(args)
    if args.command == "doctor":
        from kvmove.cli import doctor

        return doctor.run_main(args)
    from kvmove.cli import demo, demo_options

    demo_options.check(subparser, args)
    return demo.run_main(args, subparser)


if __name__ == "__main__":
    sys.exit(main())
