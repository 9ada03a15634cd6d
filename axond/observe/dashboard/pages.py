"""The dashboard's routes on the coordinator's metrics port: `/` (the page), `/dashboard.js` (its script) and
`/api/state` (the data, `view.state_view`).

Where the coordinator requires a token, the page and the data are served only to a request that carries it, as
`?token=` or an `Authorization: Bearer` header (the page passes its own `?token=` on to its data requests as that
header); the script holds no data and is served to anyone. The answers are bounded like /metrics' (one status
snapshot of at most `view.MAX_RANKS` ranks a job).
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Callable, Mapping
from importlib import resources
from typing import Any
from urllib.parse import parse_qs, urlsplit

HTML = "text/html; charset=utf-8"
JS = "text/javascript; charset=utf-8"
JSON = "application/json"


def _asset(name: str) -> bytes:
    return resources.files(__package__).joinpath(name).read_bytes()


class Dashboard:
    """A `axond.observe.http.Pages` handler: the routes above, over `read` (the data) and `token` (None: none)."""

    def __init__(self, read: Callable[[], dict[str, Any]], token: str | None) -> None:
        self._read = read
        self._token = token
        self._assets = {"/": (HTML, _asset("index.html")), "/dashboard.js": (JS, _asset("dashboard.js"))}

    def _allowed(self, query: Mapping[str, list[str]], headers: Mapping[str, str]) -> bool:
        if not self._token:
            return True
        given = (query.get("token") or [""])[0]
        auth = headers.get("authorization", "")
        if auth.lower().startswith("bearer "):
            given = given or auth[7:].strip()
        return hmac.compare_digest(given.encode(), self._token.encode())

    def __call__(self, target: str, headers: Mapping[str, str]) -> tuple[int, str, bytes] | None:
        parts = urlsplit(target)
        path, query = parts.path, parse_qs(parts.query)
        if path == "/dashboard.js":
            kind, body = self._assets[path]
            return 200, kind, body
        if path not in ("/", "/index.html", "/api/state"):
            return None
        if not self._allowed(query, headers):
            text = ("this coordinator requires its token: open /?token=TOKEN (the token of its --state-dir, "
                    "--token or --token-file), or send Authorization: Bearer TOKEN\n")
            return 401, "text/plain; charset=utf-8", text.encode()
        if path == "/api/state":
            return 200, JSON, json.dumps(self._read()).encode()
        kind, body = self._assets["/"]
        return 200, kind, body
