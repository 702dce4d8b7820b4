"""`specrouter` command line: generate | chat | serve | profile | bench | distill | demo.

Exit status: 0 done, 1 a check failed (demo, bench), 2 bad arguments or a clear error (a missing
checkpoint, a foreign tokenizer, an over-long prompt), 130 interrupted (Ctrl-C, one line)."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys


def build_parser() -> argparse.ArgumentParser:
    from specrouter.cli import bench, chat, demo, distill, generate, profile, serve

    parser = argparse.ArgumentParser(prog="specrouter", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for command in (generate, chat, serve, profile, bench, distill, demo):
        command.register(sub)
    return parser


def _interrupted() -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C during the exit stays quiet
    print("specrouter: interrupted", file=sys.stderr, flush=True)
    return 130


def main(argv: list[str] | None = None) -> int:
    try:
        from specrouter.cli.terminal import Interrupts, setup_terminal

        Interrupts.install()
        from specrouter.cli.options import UsageError
        from specrouter.errors import SpecRouterError

        setup_terminal()
        args = build_parser().parse_args(argv)
        if getattr(args, "log_level", None):
            setup_terminal(args.log_level)
        try:
            return args.func(args)
        except Exception as e:
            if Interrupts.pending:  # the error is what Ctrl-C became on its way up
                return _interrupted()
            if not isinstance(e, (UsageError, SpecRouterError)):
                raise
            print(f"specrouter {args.command}: error: {e}", file=sys.stderr)
            return 2
    except KeyboardInterrupt:
        return _interrupted()
    except BrokenPipeError:  # the reader went away (`specrouter generate ... | head`)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


def run() -> None:
    """The `specrouter` executable. After Ctrl-C it leaves with os._exit: when the interrupt
    landed inside code a C extension ran through PyRun_String (pybind11's eval, during imports),
    CPython has flagged it unhandled and would end the process by SIGINT (status -2) even though
    it was handled here; atexit handlers are skipped then, files are flushed first."""
    code = main()
    if code == 130:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(130)
    sys.exit(code)


if __name__ == "__main__":
    run()
