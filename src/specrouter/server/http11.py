"""uvicorn's h11 HTTP/1.1 protocol, with its own errors in OpenAI's JSON error shape.

A request that h11 cannot parse (a `Content-Length: -1`, a broken request line, a header block
over h11's limit) never reaches the app: uvicorn answers it with a plain-text 400 itself. This
subclass answers those in the JSON error shape the app uses, with h11's status hint: 431
Request Header Fields Too Large for a header block over the limit (16 KiB, uvicorn's
`h11_max_incomplete_event_size`), 400 otherwise. `specrouter serve` and `LiveServer` run it
(`uvicorn.Config(http=JSONErrorH11Protocol)`).
"""

from __future__ import annotations

import json

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from specrouter.server.protocol import error_body

try:
    from h11._connection import DEFAULT_MAX_INCOMPLETE_EVENT_SIZE
except ImportError:  # pragma: no cover - h11 moved it
    DEFAULT_MAX_INCOMPLETE_EVENT_SIZE = 16 * 1024

_PHRASES = {400: b"Bad Request", 431: b"Request Header Fields Too Large"}


class JSONErrorH11Protocol(H11Protocol):
    """See the module docstring."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._protocol_error: h11.RemoteProtocolError | None = None
        next_event = self.conn.next_event

        def next_event_noting_errors():
            try:
                return next_event()
            except h11.RemoteProtocolError as e:
                self._protocol_error = e
                raise

        self.conn.next_event = next_event_noting_errors

    def send_400_response(self, msg: str) -> None:
        e = self._protocol_error
        status = e.error_status_hint if e is not None and e.error_status_hint in _PHRASES else 400
        if status == 431:
            limit = self.config.h11_max_incomplete_event_size or DEFAULT_MAX_INCOMPLETE_EVENT_SIZE
            message = f"the request's header block is over the limit of {limit} bytes"
        else:
            message = f"malformed HTTP request: {e}" if e is not None else msg
        body = json.dumps(error_body(message, code="invalid_http_request")).encode()
        headers = [(b"content-type", b"application/json"), (b"connection", b"close"),
                   (b"content-length", str(len(body)).encode())]
        for event in (h11.Response(status_code=status, headers=headers, reason=_PHRASES[status]),
                      h11.Data(data=body), h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.transport.close()
