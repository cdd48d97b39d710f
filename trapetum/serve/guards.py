"""What stands between the network and the API: body limits and timeouts, Host and Origin checks, the header
read timeout. ASGI middlewares (and one uvicorn protocol class), each answering in OpenAI's error shape.

- ``BodyLimit``: request bodies over ``max_body`` bytes get 413 before parsing; a body not received within
  ``body_timeout_s`` gets 408.
- ``HostGuard``: a server on a loopback address answers only requests whose Host is one of its names
  (localhost, 127.0.0.1, ::1, plus ``--allowed-host``): a web page whose own domain was rebound to 127.0.0.1
  (DNS rebinding) sends its own Host and is refused. Any request with an ``Origin`` header (a browser's
  cross-site fetch or form) must come from this server's own origin or from a ``--cors-origin``: other web
  pages cannot drive the API even when it has no API key (cf. Ollama CVE-2024-28224). Together with the
  JSON content type required on POSTs (server.py), a page's "simple" no-preflight request cannot get in.
- ``header_timeout_protocol``: uvicorn's h11 protocol with a deadline for the request line and headers,
  from the connection's start (and from each response's end, for the next request on a kept-alive
  connection): a connection that trickles its headers (slowloris) is closed after ``timeout_s``.
"""
from __future__ import annotations

import asyncio
import time
from urllib.parse import urlsplit

from .protocol import APIError

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_BODY_TIMEOUT_S = 30.0


async def send_error(send, e: APIError) -> None:
    headers = [(b"content-type", b"application/json"), *((k.lower().encode("latin-1"), v.encode("latin-1"))
                                                           for k, v in e.headers.items())]
    body = e.content()
    headers.append((b"content-length", str(len(body)).encode()))
    await send({"type": "http.response.start", "status": e.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _too_large(n: int, cap: int, at_least: bool = False) -> APIError:
    more = "at least " if at_least else ""
    return APIError(413, f"Request body too large: {more}{n} bytes, the limit is {cap} bytes "
                    "(trapetum serve --max-body).", code="request_too_large")


class BodyLimit:
    """ASGI middleware: refuse request bodies over ``max_body`` bytes with 413 (before parsing), and bodies
    that do not arrive within ``body_timeout_s`` with 408."""

    def __init__(self, app, max_body: int, body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S):
        self.app = app
        self.max_body = max_body
        self.body_timeout_s = body_timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        for k, v in scope.get("headers", []):
            if k == b"content-length":
                try:
                    n = int(v)
                except ValueError:
                    return await send_error(send, APIError(400, "Bad Content-Length header."))
                if n > self.max_body:
                    return await send_error(send, _too_large(n, self.max_body))
        chunks, size = [], 0
        deadline = time.monotonic() + self.body_timeout_s
        while True:
            try:
                msg = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                return await send_error(send, APIError(
                    408, f"The request body did not arrive within {self.body_timeout_s:g} s.", code="timeout",
                    headers={"Connection": "close"}))
            if msg["type"] != "http.request":          # disconnected while sending the body
                return
            size += len(msg.get("body", b""))
            if size > self.max_body:
                return await send_error(send, _too_large(size, self.max_body, at_least=True))
            chunks.append(msg.get("body", b""))
            if not msg.get("more_body"):
                break
        body, sent = b"".join(chunks), False

        async def replay():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)


def host_name(host: str) -> str:
    """The name part of a Host header ("[::1]:8000" -> "::1", "LocalHost.:80" -> "localhost")."""
    h = host.strip().lower()
    if h.startswith("["):
        h = h[1:h.find("]")] if "]" in h else h[1:]
    elif h.count(":") == 1:
        h = h.rsplit(":", 1)[0]
    return h.rstrip(".")


def loopback_bind(host: str) -> bool:
    return host.lower() in LOOPBACK_NAMES or host.startswith("127.")


def allowed_hosts_for(bind: str, extra: list[str] | None) -> set[str] | None:
    """The Host names a server bound to ``bind`` answers: its loopback names (or its own address) plus
    ``extra``; None (any Host) for a wildcard bind without ``extra``."""
    extra_names = {host_name(h) for h in (extra or []) if h.strip()}
    if loopback_bind(bind):
        return set(LOOPBACK_NAMES) | {host_name(bind)} | extra_names
    if bind in ("0.0.0.0", "::", ""):
        return extra_names or None
    return {host_name(bind)} | extra_names


class HostGuard:
    """ASGI middleware: the Host allow-list (``allowed_hosts``, None = any) and the Origin check (same origin,
    or one of ``origins``; "*" allows every origin)."""

    def __init__(self, app, allowed_hosts: set[str] | None, origins: list[str] | None):
        self.app = app
        self.allowed_hosts = allowed_hosts
        self.origins = {o.rstrip("/").lower() for o in (origins or [])}

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        host = origin = None
        for k, v in scope.get("headers", []):
            if k == b"host" and host is None:
                host = v.decode("latin-1")
            elif k == b"origin" and origin is None:
                origin = v.decode("latin-1").strip()
        if self.allowed_hosts is not None and host is not None and host_name(host) not in self.allowed_hosts:
            shown = " ".join(host.split())[:80]
            return await send_error(send, APIError(
                403, f"Host '{shown}' is not allowed: this server answers to {', '.join(sorted(self.allowed_hosts))} "
                     "(trapetum serve --allowed-host NAME adds a name).", code="host_not_allowed"))
        if origin is not None and not self._origin_ok(origin, host):
            shown = " ".join(origin.split())[:80]
            return await send_error(send, APIError(
                403, f"Requests from the web origin '{shown}' are not allowed (trapetum serve --cors-origin "
                     "ORIGIN allows one).", code="origin_not_allowed"))
        return await self.app(scope, receive, send)

    def _origin_ok(self, origin: str, host: str | None) -> bool:
        o = origin.rstrip("/").lower()
        if "*" in self.origins or o in self.origins:
            return True
        if o == "null" or host is None:
            return False
        try:
            u = urlsplit(o)
        except ValueError:
            return False
        return u.scheme in ("http", "https") and u.netloc == host.strip().lower()


def header_timeout_protocol(timeout_s: float = DEFAULT_HEADER_TIMEOUT_S):
    """A subclass of uvicorn's H11Protocol that closes a connection whose request line and headers have not
    all arrived ``timeout_s`` after it opened (or after the previous response on it ended)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeaderTimeoutH11Protocol(H11Protocol):
        header_timeout_s = timeout_s

        def connection_made(self, transport):
            super().connection_made(transport)
            self._header_timer = None
            self._arm()

        def _arm(self) -> None:
            self._disarm()
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_late)

        def _disarm(self) -> None:
            t = getattr(self, "_header_timer", None)
            if t is not None:
                t.cancel()
            self._header_timer = None

        def _headers_late(self) -> None:
            self._header_timer = None
            if not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
                self.transport.close()

        def handle_events(self) -> None:
            before = self.cycle
            super().handle_events()
            if self.cycle is not before and self.cycle is not None:
                self._disarm()          # a request's headers are complete

        def on_response_complete(self) -> None:
            self._arm()                 # the next request's headers get the same deadline
            super().on_response_complete()

        def connection_lost(self, exc):
            self._disarm()
            super().connection_lost(exc)

    return HeaderTimeoutH11Protocol
