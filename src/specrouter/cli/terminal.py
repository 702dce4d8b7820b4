"""A clean terminal: warnings as one log line each, transformers kept quiet, aligned tables
(rich), and the statistics line of a finished reply."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import warnings

logger = logging.getLogger("specrouter")


class Interrupts:
    """Ctrl-C as the default handler raises it, remembered: a library that turns the
    KeyboardInterrupt into an error of its own (transformers' lazy imports report a module
    half-imported when Ctrl-C lands inside an import) still exits 130 with one line."""

    pending = False

    @classmethod
    def install(cls) -> None:
        cls.pending = False
        if (threading.current_thread() is threading.main_thread()
                and signal.getsignal(signal.SIGINT) is signal.default_int_handler):
            signal.signal(signal.SIGINT, cls._on_sigint)

    REDELIVER_S = 0.02  # an interrupt that would be swallowed is sent again this much later

    @classmethod
    def _on_sigint(cls, signum, frame):
        cls.pending = True
        if _swallows(frame):
            # raised here it would print "Exception ignored in ..." and be lost (the command
            # would run on to its end): deliver it again once this callback has returned
            timer = threading.Timer(cls.REDELIVER_S, os.kill, (os.getpid(), signal.SIGINT))
            timer.daemon = True
            timer.start()
            return
        raise KeyboardInterrupt

    @classmethod
    def handled(cls) -> None:
        """The command caught the KeyboardInterrupt and goes on (chat stops one reply)."""
        cls.pending = False


def _swallows(frame) -> bool:
    """Is `frame` a callback whose exceptions CPython reports as "Exception ignored" and drops?
    importlib's module-lock weakref callback (`_get_module_lock.<locals>.cb`) and finalizers
    (`__del__`: regex's `SetBase.__del__` while transformers imports) are where a Ctrl-C during
    start-up lands now and then (seen in the CLI tests)."""
    code = getattr(frame, "f_code", None)
    if code is None:
        return False
    return code.co_name == "__del__" or (code.co_name == "cb" and "importlib._bootstrap" in code.co_filename)


class _OneLine(logging.Formatter):
    """`specrouter: warning: message`, the message on one line."""

    def format(self, record: logging.LogRecord) -> str:
        msg = " ".join(record.getMessage().split())
        name = "" if record.name in ("specrouter", "py.warnings") else f"{record.name}: "
        return f"specrouter: {record.levelname.lower()}: {name}{msg}"


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is at the time (it may be replaced after set-up)."""

    _specrouter = True

    def __init__(self):
        super().__init__(sys.stderr)

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value):
        pass


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    logger.warning("%s", message)  # no file, line or source excerpt


def setup_terminal(level: str = "warning") -> None:
    """Route warnings (Python's and transformers') through logging, one tidy line each."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    root = logging.getLogger()
    if not any(getattr(h, "_specrouter", False) for h in root.handlers):
        handler = _StderrHandler()
        handler.setFormatter(_OneLine())
        root.addHandler(handler)
    root.setLevel(level.upper())
    warnings.showwarning = _show_warning
    if "transformers" in sys.modules:  # imported already: the environment variable came too late
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()


def print_table(headers: list[str], rows: list[list[str]], title: str | None = None,
                file=None) -> None:
    """An aligned table (text columns left, numbers right) on stdout, wide enough for long
    chain names whatever the terminal's width."""
    from rich.console import Console
    from rich.table import Table
    from rich import box

    out = file or sys.stdout
    table = Table(title=title, box=box.SIMPLE_HEAD, title_justify="left", pad_edge=False)
    numeric = [all(_is_number(r[i]) for r in rows if i < len(r) and r[i]) for i in range(len(headers))]
    for h, num in zip(headers, numeric):
        table.add_column(h, justify="right" if num else "left", no_wrap=True)
    for r in rows:
        table.add_row(*r)
    width = None if out.isatty() else 400
    Console(file=out, width=width, highlight=False, soft_wrap=True).print(table)


def _is_number(text: str) -> bool:
    try:
        float(text.rstrip("x%").split(" ")[0])
        return True
    except ValueError:
        return False


def markdown_table(lines: list[str]) -> tuple[list[str], list[list[str]]]:
    """(headers, rows) of a markdown table's lines (`| a | b |`, the `| --- |` rule skipped)."""
    cells = [[c.strip() for c in ln.strip().strip("|").split("|")] for ln in lines
             if ln.strip().startswith("|")]
    rows = [c for c in cells[1:] if not all(set(x) <= set("-: ") for x in c)]
    return cells[0], rows


def print_markdown(lines: list[str], file=None) -> None:
    """Markdown text with its tables drawn aligned (other lines printed as they are)."""
    out = file or sys.stdout
    block: list[str] = []
    for ln in [*lines, ""]:
        if ln.strip().startswith("|"):
            block.append(ln)
            continue
        if block:
            print_table(*markdown_table(block), file=out)
            block = []
        print(ln, file=out)


def stats_line(result, *, first_token_s: float | None = None, decode_s: float | None = None,
               decode_tokens: int = 0, min_rate_tokens: int = 8) -> str:
    """One reply's statistics. Per-token acceptance is the share of the tokens a level
    received that it accepted; mean acceptance length is the target tokens one cycle commits
    (accepted + the target's own recovered/bonus token, so >= 1). A decode rate is given only
    over at least `min_rate_tokens` tokens after the first cycle (shorter rates mislead)."""
    s = result.stats
    chains = ", ".join(f"{c} x{n}" for c, n in s.chains.items()) or "none"
    parts = [f"{s.generated} tokens ({result.finish_reason})", f"chain {chains}"]
    rates = s.acceptance_rates
    if rates:
        parts.append("per-token acceptance " + ", ".join(f"{p} {r:.0%}" for p, r in rates.items()))
        parts.append(f"mean acceptance length {s.mean_acceptance_length:.2f} tokens/cycle")
    if first_token_s is not None:
        parts.append(f"first token {first_token_s:.2f} s")
    if decode_s and decode_tokens >= min_rate_tokens:
        parts.append(f"decode {decode_tokens / decode_s:.1f} tok/s")
    return "[" + " | ".join(parts) + "]"


STATS_LEGEND = ("per-token acceptance: share of the tokens a level received that it accepted; "
                "mean acceptance length: target tokens per cycle, accepted + the target's own "
                "token (>= 1)")
