"""A tiny HTTP server answering GET /metrics with what a render function returns, and other paths with an optional
`Pages` handler (the coordinator's dashboard) (stdlib only)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from axond.errors import CoordinatorError
from axond.observe.exposition import CONTENT_TYPE

log = logging.getLogger("axond.metrics")

Pages = Callable[[str, Mapping[str, str]], "tuple[int, str, bytes] | None"]
"""Answers a GET of (path with its query, request headers) with (status, content type, body), or None: not found."""


REQUEST_TIMEOUT_S = 10.0
"""Seconds a scrape's connection may stay silent (reading the request, writing the answer)."""


class MetricsServer:
    """Serves `render()` at /metrics on `host:port` from a daemon thread; `port` is the bound one (0: OS-chosen)."""

    def __init__(self, host: str, port: int, render: Callable[[], str], pages: Pages | None = None) -> None:
        outer = self

        class Handler(BaseHTTPRequestHandler):
            timeout = REQUEST_TIMEOUT_S  # a client that sends its request slowly or stops reading is dropped

            def do_GET(self) -> None:
                if self.path.split("?", 1)[0] not in ("/metrics", "/metrics/"):
                    self._page()
                    return
                try:
                    body = outer._render().encode()
                except Exception as e:
                    log.exception("metrics: rendering failed")
                    self.send_error(500, f"rendering the metrics failed: {type(e).__name__}")
                    return
                self.send_response(200)
                self.send_header("Content-Type", CONTENT_TYPE)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _page(self) -> None:
                answer = None
                if outer._pages is not None:
                    try:
                        answer = outer._pages(self.path, {k.lower(): v for k, v in self.headers.items()})
                    except Exception as e:
                        log.exception("metrics: a page failed")
                        self.send_error(500, f"the page failed: {type(e).__name__}")
                        return
                if answer is None:
                    self.send_error(404, "only /metrics is served here" if outer._pages is None
                                    else "not found: / is the dashboard, /metrics the metrics")
                    return
                status, kind, body = answer
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Cache-Control", "no-store")
                if status == 401:
                    self.send_header("WWW-Authenticate", 'Bearer realm="axond"')
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                pass

        self._render = render
        self._pages = pages
        try:
            self._server = ThreadingHTTPServer((host, port), Handler)
        except OSError as e:
            raise CoordinatorError(f"cannot serve metrics on {host}:{port}: {e.strerror}; pick another "
                                   "--metrics-port") from e
        self._server.daemon_threads = True
        self.host = host
        self.port = int(self._server.server_address[1])
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.5},
                                        name=f"axond-metrics-{self.port}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop serving (bounded)."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
