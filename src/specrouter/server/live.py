"""A server running in a background thread on 127.0.0.1 (tests, benchmarks, notebooks).

>>> with LiveServer(create_app(pool)) as srv:
...     OpenAI(base_url=srv.base_url, api_key="-").completions.create(...)

The socket is bound before uvicorn starts (port 0: a free port, no race); leaving the block
shuts the server down (the app's lifespan stops the engine thread) and joins the thread.
Starting it ends the caller's OpenMP team, as `create_app` does (server/threads.py): the pool
may be loaded on the caller's thread and the server still decodes at full speed. It runs the
protocol and loop `specrouter serve` runs (httptools and uvloop when installed, server/http11.py);
`http=` and `loop=` pick others (tests of both protocols).
"""

from __future__ import annotations

import socket
import threading
import time


class LiveServer:
    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning",
                 http=None, loop: str = "auto"):
        import uvicorn

        from specrouter.server.http11 import http_protocol

        self.app = app
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.host, self.port = self.sock.getsockname()[:2]
        config = uvicorn.Config(app, log_level=log_level, loop=loop, http=http or http_protocol(),
                                lifespan="on", timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="specrouter-uvicorn", daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> LiveServer:
        from specrouter.server.threads import release_omp_team_here

        release_omp_team_here()  # torch work the caller did since create_app: one team only
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("the server did not start")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        if self.thread.is_alive():
            self.thread.join(timeout)
        self.sock.close()

    def __enter__(self) -> LiveServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
