"""How every on/off environment variable of axond is read: 1/0, true/false, yes/no, on/off (any case)."""

from __future__ import annotations

TRUE = ("1", "true", "yes", "on")
FALSE = ("0", "false", "no", "off")


def parse_flag(var: str, raw: str) -> bool:
    """The value of on/off variable `var` set to `raw`; ValueError naming it and what it accepts otherwise."""
    low = raw.strip().lower()
    if low in TRUE or low in FALSE:
        return low in TRUE
    raise ValueError(f"bad {var}={raw!r}: use 1 or 0 (true/false, yes/no, on/off)")


def flag_on(raw: str | None) -> bool:
    """Whether a diagnostic switch is on (read where raising is not an option, e.g. while reporting an error):
    only an explicit true value turns it on."""
    return raw is not None and raw.strip().lower() in TRUE
