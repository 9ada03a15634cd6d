"""Rank 0's progress display: tqdm when installed and stderr is a terminal, a plain bar or periodic lines otherwise."""

from __future__ import annotations

import io
import os
import sys
from typing import Any, TextIO


class Progress:
    """One epoch at a time: `start(epoch, steps)`, `update(step, loss, rate)` after each step, `close()`."""

    def __init__(self, enabled: bool, epochs: int, log_every: int | None, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.epochs = epochs
        self.log_every = log_every
        self.tty = enabled and self.stream.isatty()
        self._bar: Any = None
        self.epoch = 0
        self.steps = 0

    def start(self, epoch: int, steps: int, done: int = 0) -> None:
        self.epoch, self.steps = epoch, steps
        if not self.tty:
            return
        try:
            from tqdm import tqdm
        except ImportError:
            return
        cols, rows = self._size()
        self._bar = tqdm(total=steps, initial=done, file=self.stream, ascii=".#", leave=True, ncols=cols, nrows=rows,
                         bar_format="epoch " + f"{epoch}/{self.epochs}" + " [{bar:30}] {n_fmt}/{total_fmt}{postfix}")

    def _size(self) -> tuple[int, int]:
        """The terminal's (columns, rows), or (120, 24) for what it does not report (a new pseudo-terminal says 0, 0)."""
        try:
            size = os.get_terminal_size(self.stream.fileno())
        except (OSError, ValueError, AttributeError, io.UnsupportedOperation):
            return 120, 24
        return size.columns or 120, size.lines or 24

    def update(self, step: int, loss: float, rate: float) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.set_postfix_str(f"loss {loss:.4f} samples/s {rate:.0f}", refresh=False)
            self._bar.update(step - self._bar.n)
            if step == self.steps:
                self._bar.refresh()  # tqdm skips refreshes closer than 0.1 s apart: show the full bar
        elif self.tty:
            filled = 30 * step // max(self.steps, 1)
            self.stream.write(f"\repoch {self.epoch}/{self.epochs} [{'#' * filled}{'.' * (30 - filled)}] "
                              f"{step}/{self.steps} loss {loss:.4f} samples/s {rate:.0f}")
            self.stream.flush()
        else:
            every = self.log_every or max(1, self.steps // 4)
            if step % every == 0 or step == self.steps:
                self.stream.write(f"epoch {self.epoch}/{self.epochs} step {step}/{self.steps} loss {loss:.4f} "
                                  f"samples/s {rate:.0f}\n")
                self.stream.flush()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        elif self.tty:
            self.stream.write("\n")
            self.stream.flush()
