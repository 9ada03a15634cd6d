"""How one environment variable's value is read: each parser names the variable and what it accepts.

`axond.config` reads the environment once (`RuntimeEnv.from_env`) through these; a bad value raises `ConfigError`.
On/off variables are read by `axond.env_flags`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

MAX_SECONDS = 1e9
"""The most seconds a duration variable may say (about 31 years)."""


class ConfigError(ValueError):
    """An environment variable has a value axond cannot use; the message names it and what it accepts."""


def nonblank(raw: str | None) -> str | None:
    """A variable's value, None when unset or blank."""
    return raw if raw is not None and raw.strip() != "" else None


def shown(raw: str) -> str:
    """A variable's value as an error message quotes it: at most 40 characters."""
    return repr(raw) if len(raw) <= 40 else f"{raw[:20]!r}... ({len(raw)} characters)"


def parse_int(var: str, raw: str, minimum: int | None = 0, maximum: int | None = None, why: str = "") -> int:
    """`raw` as an integer within [minimum, maximum] (None: unbounded); ConfigError naming the range otherwise."""
    text = raw.strip()
    try:
        value = int(text) if len(text) <= 40 else None
    except ValueError:
        value = None
    if value is None or (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        if minimum is not None and maximum is not None:
            bound = f" from {minimum} to {maximum}"
        elif minimum is not None:
            bound = f" >= {minimum}"
        else:
            bound = f" <= {maximum}" if maximum is not None else ""
        raise ConfigError(f"bad {var}={shown(raw)}: use an integer{bound}{why}")
    return value


def parse_port(var: str, raw: str) -> int:
    """`raw` as a port number (0-65535)."""
    value = parse_int(var, raw)
    if value > 65535:
        raise ConfigError(f"bad {var}={shown(raw)}: use a port number (0-65535)")
    return value


def parse_seconds(var: str, raw: str) -> float:
    """`raw` as seconds from 0 to MAX_SECONDS."""
    try:
        value = float(raw.strip())
    except ValueError:
        value = math.nan
    if not 0.0 <= value <= MAX_SECONDS:
        raise ConfigError(f"bad {var}={shown(raw)}: use seconds from 0 (never) to {MAX_SECONDS:.0f}") from None
    return value


def parse_hex(var: str, raw: str) -> bytes:
    """`raw` as hex digits (a secret: the error does not quote it)."""
    try:
        return bytes.fromhex(raw.strip())
    except ValueError:
        raise ConfigError(f"bad {var}: use hex digits (as the worker sets it)") from None  # a secret: not echoed


def bound_from(var: str, values: Mapping[str, Any], relation: str) -> str:
    """Where a bound taken from variable `var` comes from, for the error message ("" if `var` is unset)."""
    name = var.lower()
    return f" ({relation} {var}={values[name]})" if name in values else ""


def parse_fraction(var: str, raw: str) -> float:
    """`raw` as a fraction from 0 to 1."""
    try:
        value = float(raw.strip())
    except ValueError:
        value = math.nan
    if not 0.0 <= value <= 1.0:
        raise ConfigError(f"bad {var}={shown(raw)}: use a fraction from 0 to 1 (e.g. 0.1)") from None
    return value
