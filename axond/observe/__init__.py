"""Watching a job: Prometheus metrics (`--metrics-port` on the coordinator and the worker) and a per-rank timeline.

`settings` reads the environment once, at import: collectives are instrumented only when a metrics directory
(`AXOND_METRICS_DIR`, set by a worker started with `--metrics-port`) or a timeline directory (`AXOND_TIMELINE`)
is given, and cost nothing otherwise (a group's methods are left as they are).
"""

from __future__ import annotations

from axond.observe.settings import SETTINGS, ObserveSettings

__all__ = ["SETTINGS", "ObserveSettings"]
