"""`specrouter chat`: a conversation with the target through the pool (the embedded one by
default), in the target's chat template, each reply streamed as it is committed.

Commands: /reset forgets the conversation, /stats shows the last reply's chain, acceptance and
speed and the session's totals, /exit (or Ctrl-D) quits. Ctrl-C during a reply stops that
reply; at the prompt it quits. A reply cut at --max-new-tokens (or at the end of the context)
says so. Keys typed while a reply streams are not echoed into it and are dropped when it
ends."""

from __future__ import annotations

import argparse
import contextlib
import sys

from specrouter.cli.generate import config_from_args, describe, stream_reply
from specrouter.cli.options import add_engine_arguments, add_pool_arguments, add_sampling_arguments
from specrouter.cli.terminal import STATS_LEGEND, Interrupts
from specrouter.errors import ContextLengthError

PROMPT = ">>> "
HELP = "/reset forgets the conversation, /stats shows statistics, /exit or Ctrl-D quits"


class Session:
    """The conversation and its statistics."""

    def __init__(self, system: str | None = None):
        self.system = system
        self.messages: list[dict] = []
        self.last_line: str | None = None  # stats line of the last reply
        self.replies = 0
        self.tokens = 0
        self.cycles = 0

    def reset(self) -> None:
        self.messages = []

    def prompt(self, user: str) -> list[dict]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + self.messages + [{"role": "user", "content": user}]

    def record(self, user: str, result, line: str) -> None:
        self.messages += [{"role": "user", "content": user},
                          {"role": "assistant", "content": result.text}]
        self.last_line = line
        self.replies += 1
        self.tokens += result.stats.generated
        self.cycles += result.stats.cycles

    def stats(self) -> str:
        if not self.replies:
            return "no reply yet"
        mean = self.tokens / self.cycles if self.cycles else 0.0
        text = (f"last reply: {self.last_line}\nsession: {_count(self.replies, 'reply', 'replies')}, "
                f"{_count(self.tokens, 'token')}, {mean:.2f} tokens/cycle; "
                f"{_count(len(self.messages) // 2, 'turn')} in the history")
        if "acceptance" in (self.last_line or ""):  # the legend explains words the line uses
            text += f"\n({STATS_LEGEND})"
        return text


def _count(n: int, one: str, many: str | None = None) -> str:
    return f"{n} {one if n == 1 else many or one + 's'}"


def cut_notice(result) -> str | None:
    """What to tell a person whose reply ended at the token limit, not where the model stopped."""
    if result.finish_reason != "length":
        return None
    return (f"(reply cut at the limit, {_count(result.stats.generated, 'token')}: "
            "--max-new-tokens raises it)")


@contextlib.contextmanager
def keys_not_echoed(stream):
    """While a reply streams, keys typed on the terminal `stream` are not echoed into it, and
    whatever was typed is dropped when it ends (else a line typed blind would be sent as the
    next message). Ctrl-C still interrupts. Not a terminal: nothing to do."""
    try:
        import termios

        fd = stream.fileno()
        saved = termios.tcgetattr(fd)
    except (ImportError, AttributeError, ValueError, OSError):  # termios.error is an OSError
        yield
        return
    quiet = list(saved)
    quiet[3] &= ~termios.ECHO  # lflag: no echo; ICANON and ISIG stay (Ctrl-C still signals)
    termios.tcsetattr(fd, termios.TCSANOW, quiet)
    try:
        yield
    finally:
        termios.tcflush(fd, termios.TCIFLUSH)  # drop what was typed during the reply
        termios.tcsetattr(fd, termios.TCSANOW, saved)


def cmd_chat(args: argparse.Namespace) -> int:
    from specrouter.api import SpecRouter

    config, params = config_from_args(args)
    sr = SpecRouter.from_config(config, progress=True)
    sr.encode("hi", chat=True)  # no chat template: a clear error now, not at the first reply
    print(f"{describe(sr)}\nchatting with {sr.pool.target}. {HELP}", file=sys.stderr)
    session = Session(args.system)
    while True:
        try:
            line = input(PROMPT)
        except EOFError:
            print()
            return 0
        except KeyboardInterrupt:
            print(flush=True)  # end the prompt's line: `specrouter: interrupted` starts its own
            raise
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit", "/bye"):
            return 0
        if text == "/reset":
            session.reset()
            print("(conversation forgotten)")
            continue
        if text == "/stats":
            print(session.stats())
            continue
        if text.startswith("/"):
            print(f"unknown command {text.split()[0]!r}: {HELP}")
            continue
        try:
            with keys_not_echoed(sys.stdin):
                result, stats = stream_reply(sr, session.prompt(text), params, chat=True)
        except KeyboardInterrupt:
            Interrupts.handled()
            print("(reply stopped; it is not kept in the conversation)")
            continue
        except ContextLengthError as e:
            print(f"specrouter: error: {e} (/reset starts a new conversation)", file=sys.stderr)
            continue
        notice = cut_notice(result)
        if notice:
            print(notice)
        session.record(text, result, stats)


def register(sub) -> None:
    c = sub.add_parser("chat", help="interactive chat, replies streamed (the embedded pool by "
                                    "default)", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    c.add_argument("--system", default=None, help="a system message at the start of the conversation")
    add_engine_arguments(c, k_help="draft length of a pinned --chain or of --static (default 4)")
    add_sampling_arguments(c, max_new_tokens=256)
    add_pool_arguments(c)
    c.set_defaults(func=cmd_chat)
