"""The environment of metrics and timelines, read once (see docs/environment.md)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

METRICS_DIR_ENV = "AXOND_METRICS_DIR"
TIMELINE_ENV = "AXOND_TIMELINE"


@dataclass(frozen=True)
class ObserveSettings:
    """What this process records about its collectives."""

    metrics_dir: str = ""
    """Directory the rank's collective counters are written to for its worker's /metrics ("" for none)."""
    timeline_dir: str = ""
    """Directory the rank's Chrome-trace timeline is written to ("" for none)."""

    @property
    def active(self) -> bool:
        """Whether collectives are instrumented at all."""
        return bool(self.metrics_dir or self.timeline_dir)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> ObserveSettings:
        env = os.environ if env is None else env
        return cls(metrics_dir=env.get(METRICS_DIR_ENV, "").strip(), timeline_dir=env.get(TIMELINE_ENV, "").strip())


SETTINGS = ObserveSettings.from_env()
"""This process's settings (read at import; ranks get their environment before they start)."""
