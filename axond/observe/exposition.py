"""The Prometheus text exposition format (version 0.0.4), written without a client library.

A `Family` is one metric name with its type, help and samples; `render` joins families into the body of a
/metrics answer. Label values are escaped as the format requires (backslash, double quote, newline).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

Kind = Literal["counter", "gauge", "histogram"]
Labels = Mapping[str, str]


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _labels(labels: Labels) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{_escape(str(v))}"' for k, v in labels.items()) + "}"


def _number(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if math.isnan(value):
        return "NaN"
    if float(value).is_integer() and abs(value) < 1e15:
        return str(int(value))
    return repr(float(value))


@dataclass
class Family:
    """One metric: `name` (a counter's ends in `_total`), its kind and help, and its samples."""

    name: str
    kind: Kind
    help: str
    samples: list[tuple[str, Labels, float]] = field(default_factory=list)
    """(suffix, labels, value): suffix is "" except for a histogram's `_bucket`, `_sum` and `_count`."""

    def add(self, value: float, **labels: str) -> Family:
        self.samples.append(("", labels, value))
        return self

    def add_histogram(self, bounds: Sequence[float], counts: Sequence[int], total: float, **labels: str) -> Family:
        """A histogram's samples from per-bucket (not cumulative) `counts`, one more than `bounds` (the +Inf one)."""
        running = 0
        for bound, count in zip([*bounds, math.inf], counts):
            running += count
            le = "+Inf" if math.isinf(bound) else repr(float(bound))  # as Prometheus writes it: 1.0, 0.001
            self.samples.append(("_bucket", {**labels, "le": le}, running))
        self.samples.append(("_sum", labels, total))
        self.samples.append(("_count", labels, running))
        return self


def render(families: Iterable[Family]) -> str:
    """The exposition text of `families` (each name once, in the order given)."""
    lines: list[str] = []
    for f in families:
        lines.append(f"# HELP {f.name} {f.help.replace(chr(92), chr(92) * 2).replace(chr(10), ' ')}")
        lines.append(f"# TYPE {f.name} {f.kind}")
        for suffix, labels, value in f.samples:
            lines.append(f"{f.name}{suffix}{_labels(labels)} {_number(value)}")
    return "\n".join(lines) + "\n"
