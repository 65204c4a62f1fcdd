"""The HTTP side port: /health, /metrics (Prometheus text) and /stats (JSON), served from one thread."""

from __future__ import annotations

import hmac
import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST

from kvferry.stopping import join_thread


class HttpSidePort:
    """Serves three read-only views of a running server; `close` stops the thread and frees the port.

    With a `token`, /stats and /metrics answer only requests bearing it (``Authorization: Bearer TOKEN``; else
    401), and /health answers the others with its status alone (a load balancer's probe needs no secret).
    """

    def __init__(
        self,
        host: str,
        port: int,
        *,
        health: Callable[[], dict[str, Any]],
        metrics: Callable[[], bytes],
        stats: Callable[[], dict[str, Any]],
        token: str | None = None,
    ) -> None:
        routes: dict[str, Callable[[], tuple[str, bytes]]] = {
            "/health": lambda: ("application/json", _json(health())),
            "/metrics": lambda: (CONTENT_TYPE_LATEST, metrics()),
            "/stats": lambda: ("application/json", _json(stats())),
        }
        open_routes: dict[str, Callable[[], tuple[str, bytes]]] = {
            "/health": lambda: ("application/json", _json({"status": health()["status"]})),
        }
        expected = None if token is None else f"Bearer {token}".encode()
        self._httpd = ThreadingHTTPServer((host, port), _handler_class(routes, open_routes, expected))
        self._httpd.daemon_threads = True
        self.port: int = self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="kvferry-http", daemon=True)
        self._thread.start()

    def close(self, deadline: float) -> None:
        """Stop serving and free the port. `shutdown` returns once `serve_forever` sees it (it looks every 0.5 s);
        requests still being answered run on daemon threads, not waited for."""
        self._httpd.shutdown()
        self._httpd.server_close()
        join_thread(self._thread, deadline)


def _json(obj: Any) -> bytes:
    return json.dumps(obj, default=str).encode()


Routes = dict[str, Callable[[], tuple[str, bytes]]]


def _handler_class(routes: Routes, open_routes: Routes, expected: bytes | None) -> type[BaseHTTPRequestHandler]:
    """The request handler: `routes` for requests bearing the `expected` Authorization header (all of them when
    None), `open_routes` for the others, 401 for anything else."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            given = (self.headers.get("Authorization") or "").encode()
            if expected is not None and not hmac.compare_digest(given, expected):
                route = open_routes.get(path)
                if route is None:
                    self.send_response(401)
                    self.send_header("WWW-Authenticate", 'Bearer realm="kvferry"')
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
            else:
                route = routes.get(path)
            if route is None:
                self._send(404, "text/plain", f"unknown path {self.path}; try {sorted(routes)}\n".encode())
                return
            try:
                content_type, body = route()
            except Exception as exc:  # a view must never take the port down
                self._send(500, "text/plain", f"{type(exc).__name__}: {exc}\n".encode())
                return
            self._send(200, content_type, body)

        def _send(self, status: int, content_type: str, body: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass  # scrapes every few seconds would flood the server log

    return Handler
