"""What a process records about its collectives: metrics and timeline (see docs/environment.md), read with the
rest of the environment by `axond.config.RuntimeEnv.from_env`."""

from __future__ import annotations

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
    def from_env(cls, env: Mapping[str, str]) -> ObserveSettings:
        """The settings AXOND_METRICS_DIR and AXOND_TIMELINE of `env` give."""
        return cls(metrics_dir=env.get(METRICS_DIR_ENV, "").strip(), timeline_dir=env.get(TIMELINE_ENV, "").strip())
