"""The node's read-only HTTP server: dashboard, ``/api/...`` JSON and ``/metrics`` (ASGI on hypercorn).

Routes (GET and HEAD only; anything else is 405, an unknown path 404):

* ``/``: the dashboard, one page (``static/index.html`` with its script and style, package data);
* ``/static/<name>``: those files, from a fixed list (no path is ever joined from the request);
* ``/api/status``: the whole snapshot (:meth:`OpsState.snapshot`); ``/api/<section>`` one part of it
  (``node``, ``members``, ``bandwidth``, ``traffic``, ``jobs``, ``refusals``);
* ``/metrics``: the Prometheus text format (``ops/metrics.py``).

Safety: the server opens no way into the node. It serves only what the snapshot reads, bounded by
``OpsLimits`` and, as a last guard, ``HttpConfig.max_response``; it never reads a request body,
ignores query strings, and has no route that changes anything (no job control over HTTP). Every
response says ``no-store`` and ``nosniff``, forbids framing, and carries a Content-Security-Policy
that lets the page load only its own files. Bound to loopback (the default), it answers only
requests whose ``Host`` is a loopback name, so a web page in the operator's browser cannot read it
through DNS rebinding.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import math
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from importlib import resources
from typing import Any

import trio

from fusionp2p.errors import ConfigError
from fusionp2p.ops import metrics
from fusionp2p.ops.state import OpsState

log = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

STATIC = {  # name -> content type; the only files ever served
    "index.html": "text/html; charset=utf-8",
    "dashboard.js": "text/javascript; charset=utf-8",
    "dashboard.css": "text/css; charset=utf-8",
}
SECTIONS = {
    "node": ("node",),
    "members": ("members", "members_truncated", "alive_by_role", "dead"),
    "bandwidth": ("bandwidth",),
    "traffic": ("traffic", "traffic_truncated", "traffic_totals"),
    "jobs": ("jobs", "jobs_truncated", "jobs_by_state"),
    "refusals": ("refusals", "counters"),
}
HEADERS = [
    (b"cache-control", b"no-store"),
    (b"x-content-type-options", b"nosniff"),
    (b"x-frame-options", b"DENY"),
    (b"referrer-policy", b"no-referrer"),
    (b"content-security-policy",
     b"default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
     b"base-uri 'none'; form-action 'none'; frame-ancestors 'none'"),
]
LOOPBACK_NAMES = {"localhost", "127.0.0.1", "::1", "[::1]"}


@dataclass(frozen=True, slots=True, kw_only=True)
class HttpConfig:
    host: str = "127.0.0.1"
    port: int = 0                      # 0: any free port (the URL is printed once it listens)
    max_response: int = 8 * 2**20      # bytes; the snapshot's own caps keep real ones far below
    keep_alive: float = 5.0            # seconds an idle connection is kept

    def __post_init__(self) -> None:
        try:
            ipaddress.ip_address(self.host)
        except ValueError:
            raise ConfigError(f"--http: {self.host!r} is not an IP address; give e.g. 127.0.0.1:9100 or 0.0.0.0:9100") from None
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"--http: port {self.port} is out of range")
        if self.max_response < 1024:
            raise ConfigError("HttpConfig.max_response must be at least 1024 bytes")

    @property
    def loopback(self) -> bool:
        return ipaddress.ip_address(self.host).is_loopback

    @property
    def bind(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def parse_http_addr(addr: str) -> HttpConfig:
    """``PORT``, ``HOST:PORT`` or ``[IPv6]:PORT`` (host: an IP address; loopback when only a port is given)."""
    a = addr.strip()
    host = "127.0.0.1"
    if a.startswith("["):
        h, sep, p = a[1:].partition("]:")
        if not sep:
            raise ConfigError(f"--http {addr!r}: write an IPv6 address as [ADDR]:PORT")
        host, a = h, p
    elif ":" in a:
        host, _, a = a.rpartition(":")
        if ":" in host:
            raise ConfigError(f"--http {addr!r}: write an IPv6 address as [ADDR]:PORT")
    if not (a.isascii() and a.isdigit() and len(a) <= 5):   # not "²": isdigit() accepts it, int() does not
        raise ConfigError(f"--http {addr!r}: expected PORT or HOST:PORT, e.g. 9100 or 127.0.0.1:9100")
    return HttpConfig(host=host, port=int(a))


def _dump(obj: Any) -> bytes:
    return json.dumps(_clean(obj), separators=(",", ":")).encode()


def _clean(obj: Any) -> Any:
    """JSON has no NaN or infinity: such numbers go out as null."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_clean(v) for v in obj]
    return obj


class OpsApp:
    """The ASGI application (see the module docstring)."""

    def __init__(self, state: OpsState, config: HttpConfig) -> None:
        self.state = state
        self.config = config
        pkg = resources.files("fusionp2p.ops") / "static"
        self._static = {name: (pkg / name).read_bytes() for name in STATIC}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return   # websockets: not served (hypercorn closes the connection)
        status, ctype, body, extra = self._route(scope)
        headers = [(b"content-type", ctype.encode()), (b"content-length", str(len(body)).encode()), *HEADERS, *extra]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": b"" if scope["method"] == "HEAD" else body})

    @staticmethod
    async def _lifespan(receive: Receive, send: Send) -> None:
        while True:
            msg = await receive()
            if msg["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif msg["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return

    def _route(self, scope: Scope) -> tuple[int, str, bytes, list[tuple[bytes, bytes]]]:
        text = "text/plain; charset=utf-8"
        if self.config.loopback and not _loopback_host(scope):
            return 421, text, b"this dashboard answers only to a loopback Host (localhost, 127.0.0.1, [::1])\n", []
        if scope["method"] not in ("GET", "HEAD"):
            return 405, text, b"read-only: GET and HEAD only\n", [(b"allow", b"GET, HEAD")]
        path: str = scope["path"]
        if path in ("/", "/index.html"):
            return 200, STATIC["index.html"], self._static["index.html"], []
        if path.startswith("/static/") and path[8:] in STATIC:
            return 200, STATIC[path[8:]], self._static[path[8:]], []
        try:
            if path == "/metrics":
                return self._bounded(metrics.CONTENT_TYPE, metrics.render(self.state.snapshot))
            if path.startswith("/api/"):
                name = path[5:]
                if name == "status":
                    return self._bounded("application/json", _dump(self.state.snapshot()))
                if name in SECTIONS:
                    snap = self.state.snapshot()
                    return self._bounded("application/json", _dump({k: snap[k] for k in SECTIONS[name]}))
        except Exception:   # a bug in reading the state must not end the server (nor show a traceback)
            log.exception("ops: %s failed", path)
            return 500, text, b"internal error (see the node's log)\n", []
        return 404, text, b"not found: try /, /api/status, /api/<section> or /metrics\n", []

    def _bounded(self, ctype: str, body: bytes) -> tuple[int, str, bytes, list[tuple[bytes, bytes]]]:
        if len(body) > self.config.max_response:
            log.warning("ops: response of %d bytes over the %d limit", len(body), self.config.max_response)
            return 503, "text/plain; charset=utf-8", b"response over the size limit\n", []
        return 200, ctype, body, []


def _loopback_host(scope: Scope) -> bool:
    for k, v in scope.get("headers", []):
        if k == b"host":
            name = v.decode("latin-1").strip().lower()
            if name.startswith("["):
                name = name.split("]", 1)[0] + "]"
            else:
                name = name.rsplit(":", 1)[0] if name.count(":") == 1 else name
            return name in LOOPBACK_NAMES
    return True   # HTTP/1.0 without Host: only a local client would send that to a loopback socket


async def serve_http(state: OpsState, config: HttpConfig, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
    """Serve the dashboard until cancelled; ``task_status.started(url)`` once listening."""
    from hypercorn.config import Config
    from hypercorn.trio import serve

    hc = Config()
    hc.bind = [config.bind]
    hc.keep_alive_timeout = config.keep_alive
    hc.graceful_timeout = 1.0
    hc.errorlog = logging.getLogger("fusionp2p.ops.server")
    hc.accesslog = None
    hc.include_server_header = False
    hc.h11_max_incomplete_size = 16 * 1024
    hc.alpn_protocols = ["http/1.1"]

    async def started(*, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        await serve(OpsApp(state, config), hc, task_status=task_status)   # type: ignore[arg-type]

    async with trio.open_nursery() as nursery:
        binds: list[str] = await nursery.start(started)
        url = binds[0].replace("0.0.0.0", "127.0.0.1").replace("[::]", "[::1]") + "/"
        log.info("dashboard at %s (metrics at %smetrics)", url, url)
        task_status.started(url)


__all__ = ["HttpConfig", "OpsApp", "parse_http_addr", "serve_http"]
