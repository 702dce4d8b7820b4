"""A bare HTTP/1.1 client for `specrouter bench --serve`'s paired rows (issue 34): streamed, and
whole (`stream: false`, the goal "a streamed request >= 0.95x a whole one" side by side).

On a 2-core machine the bench's client shares the cores with the server's OpenMP team, and the
`openai` client (httpx, SSE parsing, a pydantic object per chunk) costs ~0.6 ms of CPU per
chunk, 0.13 CPU-s per second of a streamed c=8 level (docs/serving-performance.md): a part of
every server/library ratio measured with it is the client's. This client asks for the same
stream (`stream: true`, usage included) over asyncio streams and parses it once, after the
last byte: its CPU per request is a few ms, so a row measured with it is the server's own
speed. Text and token count are checked like the `openai` client's (greedy texts identical).
"""

from __future__ import annotations

import asyncio
import json
import time
from urllib.parse import urlsplit


def dechunk(body: bytes) -> bytes:
    """The payload of an HTTP/1.1 `Transfer-Encoding: chunked` body."""
    out, pos = [], 0
    while True:
        end = body.index(b"\r\n", pos)
        size = int(body[pos:end].split(b";", 1)[0], 16)
        if size == 0:
            return b"".join(out)
        out.append(body[end + 2:end + 2 + size])
        pos = end + 2 + size + 2


def parse_sse(payload: bytes, chat: bool) -> tuple[str, int]:
    """(text, completion tokens) of an OpenAI SSE stream (choice 0; usage from its last chunk)."""
    parts, tokens = [], 0
    for event in payload.split(b"\n\n"):
        if not event.startswith(b"data: {"):
            continue
        chunk = json.loads(event[6:])
        if chunk.get("usage"):
            tokens = chunk["usage"]["completion_tokens"]
        for c in chunk.get("choices") or ():
            piece = (c.get("delta") or {}).get("content") if chat else c.get("text")
            if piece:
                parts.append(piece)
    return "".join(parts), tokens


async def _post(base_url: str, body: dict, chat: bool, api_key: str) -> tuple[bytes, bytes, float | None, float]:
    """POST `body` to `base_url` (".../v1") over a fresh connection, read to the end: (head, body
    dechunked, perf_counter time of the first response byte, of the last)."""
    url = urlsplit(base_url)
    path = url.path.rstrip("/") + ("/chat/completions" if chat else "/completions")
    data = json.dumps(body).encode()
    reader, writer = await asyncio.open_connection(url.hostname, url.port)
    try:
        writer.write(f"POST {path} HTTP/1.1\r\nHost: {url.hostname}:{url.port}\r\n"
                     f"Authorization: Bearer {api_key}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode() + data)
        await writer.drain()
        first, buf = None, bytearray()
        while block := await reader.read(1 << 16):
            first = first if first is not None else time.perf_counter()
            buf += block
    finally:
        writer.close()
    end = time.perf_counter()
    head, _, body_bytes = bytes(buf).partition(b"\r\n\r\n")
    status = head.split(b"\r\n", 1)[0]
    if b" 200 " not in status + b" ":
        raise RuntimeError(f"the server answered {status.decode(errors='replace')}: {body_bytes[:300]!r}")
    if b"transfer-encoding: chunked" in head.lower():
        body_bytes = dechunk(body_bytes)
    return head, body_bytes, first, end


async def stream_request(base_url: str, body: dict, chat: bool, api_key: str = "-") -> tuple[str, int, float, float]:
    """POST a streamed request to `base_url` (".../v1"): (text, completion tokens, seconds to the
    first response byte, seconds to the last)."""
    t0 = time.perf_counter()
    _, payload, first, end = await _post(base_url, dict(body, stream=True, stream_options={"include_usage": True}),
                                         chat, api_key)
    text, tokens = parse_sse(payload, chat)
    return text, tokens, (first or end) - t0, end - t0


async def whole_request(base_url: str, body: dict, chat: bool, api_key: str = "-") -> tuple[str, int, float]:
    """POST the same request not streamed (`stream: false`): (text, completion tokens, seconds)."""
    t0 = time.perf_counter()
    _, payload, _, end = await _post(base_url, dict(body, stream=False), chat, api_key)
    reply = json.loads(payload)
    choice = reply["choices"][0]
    return (choice["message"]["content"] or "") if chat else choice["text"], \
        reply["usage"]["completion_tokens"], end - t0
