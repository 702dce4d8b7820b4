"""Every code block of the README runs as written (so README and code cannot drift apart).

A tiny pool stands in where a block would need minutes: `SPECROUTER_DEFAULT_POOL` points the
name `default` at tiny checkpoints, and `path/to/draft` / `path/to/target` become their folders.
A block is run unless the README marks it, in an HTML comment on the line above:
`<!-- readme-test: skip (why) -->` (never run here), `slow` (run by `make test-slow`),
`server` (started, then the `client` blocks run against it, then Ctrl-C). The server's port
8000 becomes a free port. Links of the README must resolve inside the repository."""

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from fixtures import free_port, stop_server, wait_for_health

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MARK = re.compile(r"<!-- readme-test: (skip|slow|server|client)\b(.*)-->")


@dataclass
class Block:
    line: int  # 1-based line of the opening fence
    lang: str  # bash | python
    body: str  # dedented
    mark: str | None  # skip | slow | server | client | None (run)
    reason: str


def readme_blocks(text: str | None = None) -> list[Block]:
    lines = (text if text is not None else README.read_text()).splitlines()
    blocks, i, mark, reason = [], 0, None, ""
    while i < len(lines):
        stripped = lines[i].strip()
        m = MARK.search(stripped)
        if m:
            mark, reason = m.group(1), m.group(2).strip()
        elif stripped.startswith("```"):
            indent = len(lines[i]) - len(lines[i].lstrip())
            start, body = i, []
            i += 1
            while not lines[i].strip().startswith("```"):
                body.append(lines[i][indent:])
                i += 1
            blocks.append(Block(start + 1, stripped[3:].strip(), "\n".join(body), mark, reason))
            mark, reason = None, ""
        elif stripped:
            mark, reason = None, ""
        i += 1
    return blocks


@pytest.fixture(scope="module")
def readme_env(tiny_pool_dirs, tmp_path_factory):
    """Environment of the blocks: `default` is a tiny pool with a saved cost profile, the
    `specrouter` command runs this interpreter and these sources."""
    from specrouter.models.pool import Pool
    from specrouter.router.profile import default_profile_path
    from specrouter.router.setup import load_or_sweep_profile

    d = tiny_pool_dirs
    pool_paths = ["ngram", str(d["random"]), str(d["target"])]
    # one sweep, saved even if the cores are busy, so each block's process need not sweep again
    profile = load_or_sweep_profile(Pool.load(pool_paths), progress=False)
    profile.save(default_profile_path())
    shim = tmp_path_factory.mktemp("bin")
    for name, run in (("specrouter", f"{sys.executable} -m specrouter.cli.main"),
                      ("python", sys.executable)):  # a script, not a link: the venv stays active
        (shim / name).write_text(f"#!/bin/sh\nexec {run} \"$@\"\n")
        (shim / name).chmod(0o755)
    env = {**os.environ, "SPECROUTER_DEFAULT_POOL": os.pathsep.join(pool_paths),
           "PATH": f"{shim}{os.pathsep}{os.environ['PATH']}", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    subs = {"path/to/draft": str(d["random"]), "path/to/target": str(d["target"]),
            "benchmarks/": f"{ROOT}/benchmarks/"}
    return env, subs, tmp_path_factory.mktemp("readme-cwd")


def _substitute(body: str, subs: dict) -> str:
    for old, new in subs.items():
        body = body.replace(old, new)
    return body


def run_block(block: Block, readme_env, timeout: float = 600, extra: dict | None = None):
    env, subs, cwd = readme_env
    body = _substitute(block.body, {**subs, **(extra or {})})
    cmd = ["bash", "-e", "-o", "pipefail", "-c", body] if block.lang == "bash" else [sys.executable, "-c", body]
    r = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"README line {block.line} failed ({r.returncode}):\n{body}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    return r


def test_every_block_is_run_or_says_why_not():
    blocks = readme_blocks()
    assert len(blocks) >= 8
    for b in blocks:
        assert b.lang in ("bash", "python"), f"README line {b.line}: a block needs a language"
        if b.mark in ("skip", "slow"):
            assert b.reason.startswith("(") and len(b.reason) > 4, f"README line {b.line}: say why"
    marks = [b.mark for b in blocks]
    assert marks.count("server") == 1 and marks.count("client") >= 1


def test_the_parser_sees_marks_and_indented_blocks():
    text = ("x\n<!-- readme-test: skip (hours) -->\n  ```bash\n  a \\\n      b\n  ```\n\n"
            "```python\nprint(1)\n```\n")
    a, b = readme_blocks(text)
    assert (a.line, a.lang, a.body, a.mark, a.reason) == (3, "bash", "a \\\n    b", "skip", "(hours)")
    assert (b.lang, b.body, b.mark) == ("python", "print(1)", None)


def test_links_resolve_inside_the_repository():
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README.read_text())
    local = [u for u in links if "://" not in u]
    assert local, "no local links found"
    for url in local:
        assert not url.startswith(("..", "/")), f"{url}: outside the repository"
        assert (ROOT / url).exists(), f"{url} does not exist"


PLAIN = [b for b in readme_blocks() if b.mark is None]
SLOW = [b for b in readme_blocks() if b.mark == "slow"]


@pytest.mark.parametrize("block", PLAIN, ids=[f"line{b.line}" for b in PLAIN])
def test_block_runs(block, readme_env):
    run_block(block, readme_env)


@pytest.mark.slow
@pytest.mark.parametrize("block", SLOW, ids=[f"line{b.line}" for b in SLOW])
def test_slow_block_runs(block, readme_env):
    run_block(block, readme_env, timeout=1800)


def test_server_and_client_blocks(readme_env):
    pytest.importorskip("uvicorn")
    pytest.importorskip("openai")
    env, subs, cwd = readme_env
    blocks = readme_blocks()
    (server,) = [b for b in blocks if b.mark == "server"]
    port = str(free_port())
    extra = {"8000": port}
    proc = subprocess.Popen(["bash", "-c", "exec " + _substitute(server.body, {**subs, **extra})],
                            env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        assert wait_for_health(proc, int(port), 180, "the README's server") == 200
        for b in blocks:
            if b.mark == "client":
                out = run_block(b, readme_env, timeout=120, extra=extra).stdout
                assert out.strip(), f"README line {b.line} printed nothing"
    finally:
        stop_server(proc)
    assert proc.returncode in (0, 130), proc.returncode
