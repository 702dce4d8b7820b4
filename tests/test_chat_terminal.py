"""`specrouter chat` as a person sees it, on a real terminal (a pseudo-terminal): keys typed
while a reply streams are not echoed into it (and not sent afterwards), a reply cut at the
token limit says so, the acceptance legend comes only with a line that uses its words, counts
are in good grammar ("1 reply", "1 turn"), and Ctrl-C at the prompt ends the prompt's line
before `specrouter: interrupted`."""

from __future__ import annotations

import os
import re
import select
import signal
import subprocess
import sys
import threading
import time

import pytest

from specrouter import SpecRouter
from specrouter.cli.main import main

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="pseudo-terminals are POSIX")
TYPED = b"TYPED WHILE REPLYING"


@pytest.fixture
def tiny_default(tiny_pool_dirs, monkeypatch):
    d = tiny_pool_dirs
    monkeypatch.setenv("SPECROUTER_DEFAULT_POOL", os.pathsep.join(["ngram", str(d["random"]), str(d["target"])]))
    return d


class Screen:
    """The terminal's other end: what the program shows (echo included), and a keyboard that
    answers the n-th prompt with the n-th line of `answers`."""

    def __init__(self, master: int, answers: list[bytes]):
        self.master, self.answers, self.text = master, answers, b""
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        answered = 0
        while True:
            try:
                chunk = os.read(self.master, 4096)
            except OSError:  # the terminal was closed
                return
            if not chunk:
                return
            self.text += chunk
            prompts = self.text.count(b">>> ")
            while answered < min(prompts, len(self.answers)):
                os.write(self.master, self.answers[answered] + b"\n")
                answered += 1


@pytest.mark.parametrize("chain, speculates", [(["ngram", "draft", "target"], True), (["target"], False)])
def test_chat_on_a_terminal(tiny_default, monkeypatch, chain, speculates):
    master, slave = os.openpty()
    tty_in = os.fdopen(slave, "r", buffering=1)
    tty_out = os.fdopen(os.dup(slave), "w", buffering=1)
    monkeypatch.setattr(sys, "stdin", tty_in)
    monkeypatch.setattr(sys, "stdout", tty_out)
    real = SpecRouter.from_config
    cycles = []

    def typing_during_the_reply(config, **kw):
        sr = real(config, **kw)

        def on_cycle(stats):
            cycles.append(stats)
            if len(cycles) == 2:  # the first reply is streaming: a person types the next line
                os.write(master, TYPED + b"\n")
                time.sleep(0.05)  # echo (if on) happens as the terminal receives the keys

        sr.engine.on_cycle = on_cycle
        return sr

    monkeypatch.setattr(SpecRouter, "from_config", typing_during_the_reply)
    screen = Screen(master, [b"hello", b"/stats", b"/exit"])
    try:
        rc = main(["chat", "--dtype", "float64", "--max-new-tokens", "6", "--chain", *chain,
                   *(["--k", "2"] if speculates else [])])
    finally:
        tty_out.flush()
        time.sleep(0.2)
        tty_in.close()
        tty_out.close()
        screen.thread.join(5)
        os.close(master)
    text = screen.text.decode(errors="replace").replace("\r\n", "\n")
    assert rc == 0 and len(cycles) >= 2, text
    first, reply, stats, _ = text.split(">>> ", 3)
    assert TYPED.decode() not in text  # not echoed into the reply, and not sent after it
    assert "reply cut at the limit, 6 tokens" in reply and "--max-new-tokens" in reply
    assert "session: 1 reply, 6 tokens" in stats and "1 turn in the history" in stats
    assert "unknown command" not in text
    legend = "(per-token acceptance: share of the tokens a level received"
    assert ("per-token acceptance" in stats.split("\n")[1]) is speculates
    assert (legend in stats) is speculates


def test_ctrl_c_at_the_chat_prompt_ends_the_line_first(tiny_pool_dirs):
    d = tiny_pool_dirs
    master, slave = os.openpty()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "specrouter.cli.main", "chat", "--models", str(d["draft"]),
                             str(d["target"]), "--dtype", "float64", "--static"],
                            stdin=slave, stdout=slave, stderr=slave, env=env)
    os.close(slave)
    seen, deadline = b"", time.monotonic() + 120
    try:
        while not seen.endswith(b">>> "):
            assert time.monotonic() < deadline and proc.poll() is None, seen
            if select.select([master], [], [], 0.5)[0]:
                seen += os.read(master, 4096)
        time.sleep(0.3)  # waiting in input()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 130
        while select.select([master], [], [], 0.5)[0]:
            try:
                chunk = os.read(master, 4096)
            except OSError:
                break
            if not chunk:
                break
            seen += chunk
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(master)
    screen = seen.decode(errors="replace").replace("\r\n", "\n")
    assert re.search(r">>> \n(\^C)?specrouter: interrupted\n?$", screen), screen[-200:]
    assert "Traceback" not in screen
