"""uvicorn's HTTP/1.1 protocols (httptools, h11), with their own errors in OpenAI's JSON shape.

A request that the parser cannot read (a `Content-Length: -1`, a broken request line, a header
block over the limit) never reaches the app: uvicorn answers it with a plain-text 400 itself.
These subclasses answer those in the JSON error shape the app uses: 431 Request Header Fields
Too Large for a request head over the limit (16 KiB, uvicorn's `h11_max_incomplete_event_size`),
400 otherwise. `http_protocol()` is the one `specrouter serve` and `LiveServer` run: the
httptools one (llhttp, C) when httptools is importable, else the h11 one (pure Python;
docs/serving-performance.md has the A/B).
"""

from __future__ import annotations

import json
import sys

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from specrouter.server.protocol import error_body

try:
    from h11._connection import DEFAULT_MAX_INCOMPLETE_EVENT_SIZE
except ImportError:  # pragma: no cover - h11 moved it
    DEFAULT_MAX_INCOMPLETE_EVENT_SIZE = 16 * 1024

_PHRASES = {400: b"Bad Request", 431: b"Request Header Fields Too Large"}


def head_limit(config) -> int:
    """Bytes a request head may take (the same for both protocols)."""
    return config.h11_max_incomplete_event_size or DEFAULT_MAX_INCOMPLETE_EVENT_SIZE


def send_json_error(transport, status: int, detail: str | None, limit: int) -> None:
    """Write the JSON error reply (400 or 431) on `transport` and close the connection."""
    if status == 431:
        message = f"the request's header block is over the limit of {limit} bytes"
    else:
        status, message = 400, f"malformed HTTP request: {detail}"
    body = json.dumps(error_body(message, code="invalid_http_request")).encode()
    transport.write(b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\nconnection: close\r\n"
                    b"content-length: %d\r\n\r\n" % (status, _PHRASES[status], len(body)) + body)
    transport.close()


class JSONErrorH11Protocol(H11Protocol):
    """h11 (pure Python); see the module docstring."""

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
        send_json_error(self.transport, status, e if e is not None else msg, head_limit(self.config))


try:
    import httptools
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ImportError:  # no httptools: h11 only
    HttpToolsProtocol = None


class _HeadTooLarge(Exception):
    pass


if HttpToolsProtocol is not None:

    class JSONErrorHttpToolsProtocol(HttpToolsProtocol):
        """httptools (llhttp, C); see the module docstring. llhttp has no limit on the head, so
        this one counts it: the request line and headers as the parser hands them over (a
        complete head), and the bytes received while a head is still incomplete."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._limit = head_limit(self.config)
            self._in_head = True  # between a message's end and the next one's headers
            self._head_bytes = 0  # received while in the head (raw, for an incomplete head)
            self._head_size = 0  # request line and headers parsed so far

        def data_received(self, data: bytes) -> None:
            if self._in_head:
                self._head_bytes += len(data)
            super().data_received(data)  # a parse error calls send_400_response
            if self._in_head and self._head_bytes > self._limit and not self.transport.is_closing():
                send_json_error(self.transport, 431, None, self._limit)

        def on_message_begin(self) -> None:
            self._head_size = 16  # the method and " HTTP/1.1\r\n"
            super().on_message_begin()

        def on_url(self, url: bytes) -> None:
            self._head_size += len(url)
            super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            self._head_size += len(name) + len(value) + 4
            if self._head_size > self._limit:
                raise _HeadTooLarge  # feed_data raises HttpParserCallbackError
            super().on_header(name, value)

        def on_headers_complete(self) -> None:
            self._in_head = False
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            self._in_head, self._head_bytes = True, 0
            super().on_message_complete()

        def send_400_response(self, msg: str) -> None:
            e = sys.exc_info()[1]  # called from the base's `except httptools.HttpParserError`
            if isinstance(getattr(e, "__context__", None), _HeadTooLarge):
                send_json_error(self.transport, 431, None, self._limit)
            else:
                send_json_error(self.transport, 400, e if e is not None else msg, self._limit)
else:  # pragma: no cover - httptools not installed
    JSONErrorHttpToolsProtocol = None


def http_protocol():
    """The protocol class to serve with: httptools' when importable, else h11's."""
    return JSONErrorHttpToolsProtocol or JSONErrorH11Protocol
