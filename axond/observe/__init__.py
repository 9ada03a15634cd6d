"""Watching a job: Prometheus metrics (`--metrics-port` on the coordinator and the worker) and a per-rank timeline.

A group's collectives are instrumented only when its `RuntimeEnv` (read by `init_process_group`, see
`axond.config`) gives a metrics directory (`AXOND_METRICS_DIR`, set by a worker started with `--metrics-port`) or a
timeline directory (`AXOND_TIMELINE`), and cost nothing otherwise (a group's methods are left as they are).
"""

from __future__ import annotations

from axond.observe.settings import ObserveSettings

__all__ = ["ObserveSettings"]
