"""Checks at the edge, before any route is matched (ASGI middleware `EdgeGuard`).

1. Host (DNS rebinding): a web page whose name an attacker re-points at 127.0.0.1 reaches a
   loopback server from the victim's browser, with its own name in the `Host` header. So
   - `allowed_hosts=None` (the default): a request that arrives at a loopback address
     (the server is bound to 127.0.0.1 / ::1, or reached through them) must name a loopback
     host: `localhost`, `*.localhost`, or a loopback IP literal (127.0.0.0/8, ::1), any port.
     Requests arriving at other addresses (a server bound to a LAN address or 0.0.0.0, reached
     over the network) may name any host.
   - `allowed_hosts=("api.example.com", "*.example.com")`: only those names (any port), on
     every address; `("*",)` turns the check off (behind a reverse proxy that rewrites Host).
   A refused Host gets 421 Misdirected Request. A request without a Host header (HTTP/1.0) is
   let through: a browser always sends one.
2. API key: with `api_key` set, every path under /v1 (and /tokenize, /detokenize) needs `Authorization: Bearer <key>`, checked
   before routing (an unknown /v1 route is a 401 to a caller without the key, not a 404 that
   tells which routes exist); with `metrics_auth`, /health and /metrics need it too (they show
   model names, request counts and queue depth). Otherwise /health and /metrics stay open (as
   vLLM), for probes and scrapers on loopback.
3. Header size: a header block over `MAX_HEADER_BYTES` (16 KiB, h11's limit for a block that
   arrives in pieces, applied here to one that arrived whole) is a 431.
All answer in OpenAI's error shape.
"""

from __future__ import annotations

import hmac
import ipaddress
import json

from specrouter.config import ServerConfig
from specrouter.server.protocol import error_body

OPS_PATHS = frozenset({"/health", "/metrics"})
API_PATHS = frozenset({"/tokenize", "/detokenize"})  # API routes outside /v1 (vLLM's, llama-server's)
MAX_HEADER_BYTES = 16 * 1024


def host_name(value: str) -> str:
    """The name part of a Host header value, lower case: '[::1]:8000' -> '::1',
    'LocalHost.:80' -> 'localhost'."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1:].split("]", 1)[0]
    name, sep, port = value.rpartition(":")
    if sep and port.isdigit() and ":" not in name:
        value = name
    return value.rstrip(".")


def is_loopback_name(name: str) -> bool:
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        ip = ipaddress.ip_address(name)
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)  # ::ffff:127.0.0.1 (a dual-stack socket's view)
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)


def host_allowed(name: str, allowed: tuple[str, ...] | None, local_address: str | None) -> bool:
    """Whether a request naming host `name` may be served (see the module docstring)."""
    if allowed is None:
        if local_address is None or not is_loopback_name(local_address):
            return True
        return is_loopback_name(name)
    for pattern in allowed:
        pattern = pattern.lower().rstrip(".")
        if pattern == "*" or pattern == name:
            return True
        if pattern.startswith("*.") and name.endswith(pattern[1:]):
            return True
    return False


def key_matches(authorization: str, key: str) -> bool:
    scheme, _, token = authorization.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())


class EdgeGuard:
    """ASGI middleware: the Host and API-key checks of the module docstring."""

    def __init__(self, app, config: ServerConfig):
        self.app, self.config = app, config

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        refusal = self.check(scope)
        if refusal is not None:
            return await _send_error(send, *refusal)
        return await self.app(scope, receive, send)

    def check(self, scope) -> tuple[int, dict, dict[str, str]] | None:
        """(status, error body, headers) of a refusal, or None."""
        raw = scope.get("headers", ())
        size = sum(len(k) + len(v) + 4 for k, v in raw)  # "name: value\r\n"
        if size > MAX_HEADER_BYTES:
            return 431, error_body(f"the request's header block is over the limit of "
                                   f"{MAX_HEADER_BYTES} bytes", code="invalid_http_request"), {}
        headers = {}
        for k, v in raw:
            headers.setdefault(k.decode("latin-1").lower(), v.decode("latin-1"))
        host = headers.get("host")
        server = scope.get("server")
        if host is not None:
            name = host_name(host)
            if not host_allowed(name, self.config.allowed_hosts, server[0] if server else None):
                return 421, error_body(
                    f"the Host {host!r} is not served here: this server accepts "
                    + ("loopback names (localhost, 127.0.0.1, [::1]) on its loopback address"
                       if self.config.allowed_hosts is None else
                       f"the hosts {list(self.config.allowed_hosts)}")
                    + " (specrouter serve --allowed-hosts)", param=None, code="invalid_host"), {}
        key, path = self.config.api_key, scope["path"]
        guarded = path == "/v1" or path.startswith("/v1/") or path in API_PATHS or (
            self.config.metrics_auth and path in OPS_PATHS)
        if key and guarded and not key_matches(headers.get("authorization", ""), key):
            return 401, error_body("invalid or missing API key: send 'Authorization: Bearer <key>'",
                                   type="authentication_error", code="invalid_api_key"), \
                {"WWW-Authenticate": "Bearer"}
        return None


async def _send_error(send, status: int, body: dict, headers: dict[str, str]) -> None:
    raw = json.dumps(body).encode()
    hdrs = [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]
    hdrs += [(k.lower().encode(), v.encode()) for k, v in headers.items()]
    await send({"type": "http.response.start", "status": status, "headers": hdrs})
    await send({"type": "http.response.body", "body": raw})
