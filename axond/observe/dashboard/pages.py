"""The dashboard's routes on the coordinator's metrics port: `/` (the page), `/dashboard.js` (its script),
`/api/state` (the data, `view.state_view`) and `/api/timeline?job=J` (the job's merged timeline, where the
coordinator sees the directory its ranks write their timelines to: `timeline_dir`, its own AXOND_TIMELINE, e.g.
under `axond worker --standalone` or on a shared filesystem; the files of the job's current ranks, by rank and pid,
merged as `axond timeline merge` does, at most `MAX_TIMELINE_BYTES`).

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
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from axond.observe.merge import TimelineError, merge_files

HTML = "text/html; charset=utf-8"
JS = "text/javascript; charset=utf-8"
JSON = "application/json"
TEXT = "text/plain; charset=utf-8"
MAX_TIMELINE_BYTES = 256 * 1024 * 1024
"""The most bytes of rank timeline files one download merges (larger: 413, merge them with `axond timeline merge`)."""


def _asset(name: str) -> bytes:
    return resources.files(__package__).joinpath(name).read_bytes()


class Dashboard:
    """A `axond.observe.http.Pages` handler: the routes above, over `read` (the data) and `token` (None: none)."""

    def __init__(self, read: Callable[[], dict[str, Any]], token: str | None, timeline_dir: str = "") -> None:
        self._read = read
        self._token = token
        self.timeline_dir = timeline_dir
        """Where the ranks write their timelines, as this coordinator sees it ("": no timeline downloads)."""
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
        if path not in ("/", "/index.html", "/api/state", "/api/timeline"):
            return None
        if not self._allowed(query, headers):
            text = ("this coordinator requires its token: open /?token=TOKEN (the token of its --state-dir, "
                    "--token or --token-file), or send Authorization: Bearer TOKEN\n")
            return 401, "text/plain; charset=utf-8", text.encode()
        if path == "/api/state":
            data = self._read()
            data["timeline"] = bool(self.timeline_dir)
            return 200, JSON, json.dumps(data).encode()
        if path == "/api/timeline":
            return self._timeline((query.get("job") or [""])[0])
        kind, body = self._assets["/"]
        return 200, kind, body

    def _timeline(self, job: str) -> tuple[int, str, bytes]:
        """The merged timeline of `job`'s current ranks (their files `rank-R-pid-P.json`), or why there is none."""
        if not self.timeline_dir:
            return 404, TEXT, (b"this coordinator has no timeline directory: start it with AXOND_TIMELINE set to "
                               b"the directory the ranks write to (or merge the files with axond timeline merge)\n")
        found = next((j for j in self._read()["jobs"] if j["job"] == job), None)
        if found is None:
            return 404, TEXT, f"no job {job!r}: pass ?job= a job the dashboard shows\n".encode()
        root = Path(self.timeline_dir)
        files = [root / f"rank-{r['rank']}-pid-{r['pid']}.json" for r in found["ranks"] if r.get("pid")]
        files = [f for f in files if f.is_file()]
        if not files:
            return 404, TEXT, (f"no timeline file of job {job!r}'s ranks in {root} (rank-RANK-pid-PID.json): run it "
                               f"with AXOND_TIMELINE={root}\n").encode()
        if sum(f.stat().st_size for f in files) > MAX_TIMELINE_BYTES:
            return 413, TEXT, (f"job {job!r}'s timeline files exceed {MAX_TIMELINE_BYTES >> 20} MiB: merge them "
                               f"with axond timeline merge {root}\n").encode()
        try:
            return 200, JSON, json.dumps(merge_files(files), separators=(",", ":")).encode()
        except (TimelineError, OSError) as e:
            return 500, TEXT, f"cannot merge job {job!r}'s timeline: {e}\n".encode()
