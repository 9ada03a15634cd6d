"""The thresholds used outside the tcp backend, as a decision table (the tcp backend's own: its `policy`).

Each constant says in one line what it decides, and `(#name)` is its entry in docs/design/tuning.md (the machine,
command, date and measurements behind the value). The defaults assume that page's machine, a 2-core x86 VM (AMD
EPYC) with every rank on loopback; re-measure them there for another one. This module imports nothing of a backend.
"""

from __future__ import annotations

HOST_COPY_SLOW_DISTANCE = 32
"""A copy whose (destination - source) modulo a page is 1 to this - 1 bytes is slow (#host_copy_slow_distance)."""
HOST_COPY_MIN_BYTES = 8192
"""Smallest copy `host_copy.copy` checks for a slow page distance (#host_copy_min_bytes)."""
HOST_COPY_MAX_BYTES = (512 << 10) - 1
"""Largest copy `host_copy.copy` runs as NumPy's vector loop at a slow page distance (#host_copy_max_bytes)."""
STRING_MIN_BYTES = 1 << 20
"""Size from which `host_copy.large_copy` copies with `rep movsb` where the page distance allows (#string_min_bytes)."""
TORCH_SYNC_BYTES = 64 << 10
"""The torch backend's async collectives up to this size run on the calling thread (#torch_sync_bytes)."""
