"""`specrouter serve` end to end: a subprocess on 127.0.0.1, the API key from the environment,
a completion through the openai client, a clean shutdown on SIGINT."""

import argparse
import http.client
import json
import os
import signal
import socket
import subprocess
import sys

import pytest
from fixtures import free_port, stop_server, wait_for_health

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from specrouter.cli import serve as cli_serve  # noqa: E402
from specrouter.config import ServerConfig  # noqa: E402

LAUNCH = "import sys\nfrom specrouter.cli.main import main\nsys.exit(main(sys.argv[1:]))\n"


def _parser():
    p = argparse.ArgumentParser()
    cli_serve.register(p.add_subparsers(dest="command"))
    return p


def test_serve_flags_and_defaults():
    a = _parser().parse_args(["serve", "--models", "x"])
    assert (a.host, a.port, a.max_num_seqs, a.max_model_len, a.dtype, a.model_timeout) == (
        "127.0.0.1", 8000, 8, 2048, "auto", 30.0)
    cfg = cli_serve.config_from_args(a)
    assert cfg.pool.models == ("x",) and cfg.server.k == 4 and cfg.server.adaptive
    a = _parser().parse_args(["serve", "--models", "d", "t", "--chain", "ngram", "d", "t",
                              "--api-key", "s", "--max-queue", "3", "--k", "2"])
    assert a.chain == ["ngram", "d", "t"] and a.api_key == "s" and a.max_queue == 3
    cfg = cli_serve.config_from_args(a)
    assert (cfg.server.chain, cfg.server.k, cfg.server.max_queue) == (("ngram", "d", "t"), 2, 3)
    assert cfg.server.stream_interval == ServerConfig().stream_interval
    a = _parser().parse_args(["serve", "--models", "x", "--stream-interval", "4"])
    assert cli_serve.config_from_args(a).server.stream_interval == 4
    a = _parser().parse_args(["serve", "--models", "x", "--stream-interval", "auto"])
    assert cli_serve.config_from_args(a).server.stream_interval == 0
    assert cfg.server.team_governor  # default: on (engine/contention.py)
    a = _parser().parse_args(["serve", "--models", "x", "--no-team-governor"])
    assert not cli_serve.config_from_args(a).server.team_governor
    # no --models: the embedded default pool; --k alone is the draft length of pinned requests
    cfg = cli_serve.config_from_args(_parser().parse_args(["serve", "--k", "3"]))
    assert cfg.pool.models == ("default",) and cfg.server.k == 3 and cfg.server.chain is None
    assert (a.metrics_auth, a.allowed_hosts) == (False, None)
    a = _parser().parse_args(["serve", "--models", "x", "--metrics-auth", "--allowed-hosts",
                              "api.example.com", "*.corp.example"])
    assert a.metrics_auth and a.allowed_hosts == ["api.example.com", "*.corp.example"]
    cfg = cli_serve.config_from_args(a)
    assert cfg.server.metrics_auth and cfg.server.allowed_hosts == ("api.example.com", "*.corp.example")
    assert cli_serve._is_loopback("127.0.0.1") and cli_serve._is_loopback("::1")
    assert not cli_serve._is_loopback("0.0.0.0")


def test_serve_subprocess(tiny_pool_dirs):
    d = tiny_pool_dirs
    port = free_port()
    env = {**os.environ, "SPECROUTER_API_KEY": "env-key", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-c", LAUNCH, "serve", "--models", str(d["mid"]), str(d["target"]),
           "--target", "target", "--dtype", "float64", "--port", str(port), "--max-model-len", "128",
           "--chain", "ngram", "mid", "target", "--k", "3", "--log-level", "warning",
           "--metrics-auth"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        wait_for_health(proc, port, 90, "the server")  # /health wants the key: checked below
        for key, status in ((None, 401), ("env-key", 200)):  # --metrics-auth
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            conn.request("GET", "/health", headers={"Authorization": f"Bearer {key}"} if key else {})
            assert conn.getresponse().status == status
            conn.close()
        # the HTTP layer's own errors are JSON (server/http11.py is the protocol serve runs)
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                         b"Content-Length: -1\r\n\r\n")
            reply = b""
            while chunk := sock.recv(65536):
                reply += chunk
        head, _, body = reply.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 400") and b"application/json" in head
        assert json.loads(body)["error"]["code"] == "invalid_http_request"
        base = f"http://127.0.0.1:{port}/v1"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=base, api_key="wrong", max_retries=0).models.list()
        client = openai.OpenAI(base_url=base, api_key="env-key", max_retries=0, timeout=30)
        r = client.completions.create(model="target", prompt="def add(a, b):", max_tokens=8,
                                      temperature=0)
        assert r.usage.completion_tokens >= 1
        assert set(r.usage.model_extra["specrouter"]["chains"]) <= {"ngram>mid>target", "target"}
    finally:
        stop_server(proc)
    assert proc.returncode in (0, 130, -signal.SIGINT), proc.returncode


def test_serve_freezes_the_set_up_heap_before_serving(monkeypatch):
    """cmd_serve freezes what set-up left (server/threads.py `freeze_heap`) before uvicorn runs:
    a full collection then walks only what serving creates."""
    import gc

    import uvicorn

    from specrouter.server import threads

    seen = {}
    monkeypatch.setattr(threads, "on_passing_thread", lambda fn: object())  # no pool: a stand-in app
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: seen.setdefault("frozen", gc.get_freeze_count()))
    try:
        assert cli_serve.cmd_serve(_parser().parse_args(["serve", "--models", "x"])) == 0
        assert seen["frozen"] > 1000  # everything alive at set-up's end
    finally:
        gc.unfreeze()
    assert gc.get_freeze_count() == 0
