"""The KV-store half of CoordinatorState: each call scoped to a job's current generation."""

from __future__ import annotations

import threading
from collections.abc import Hashable

from axond.coordinator.errors import FailedPrecondition, InvalidArgument, short
from axond.coordinator.jobs import Job
from axond.coordinator.kv import KvSpace
from axond.coordinator.persistence.journal import TxLock


class KvOps:
    """Store operations; mixed into CoordinatorState, which supplies the lock, jobs and notify."""

    lock: threading.RLock | TxLock

    def _job(self, name: str) -> Job:
        raise NotImplementedError

    def _notify(self, *topic: Hashable) -> None:
        raise NotImplementedError

    def _mark_kv(self, job: str, key: str) -> None:
        raise NotImplementedError

    def _mark_barrier(self, job: str, name: str) -> None:
        raise NotImplementedError

    def space(self, job: str, generation: int) -> KvSpace:
        """The KV space of the job's current generation; stale or unknown generations are refused."""
        j = self._job(job)
        if generation > j.generation or generation < 1:
            raise InvalidArgument(f"generation {generation} of job {short(job)} does not exist (current {j.generation})")
        if generation < j.generation or j.state.terminal:
            why = f": {j.reason[:300]}" if j.reason else ""
            raise FailedPrecondition(
                f"generation {generation} of job {short(job)} is over (now {j.generation}, {j.state.name}{why}); "
                "the job restarted or finished, so ranks of the old generation must exit"
            )
        return j.kv

    def kv_set(self, job: str, generation: int, key: str, value: bytes) -> None:
        with self.lock:
            self.space(job, generation).set(key, value)
            self._notify("key", job, generation, key)

    def kv_get(self, job: str, generation: int, key: str) -> bytes | None:
        with self.lock:
            return self.space(job, generation).get(key)

    def kv_add(self, job: str, generation: int, key: str, delta: int) -> int:
        with self.lock:
            value = self.space(job, generation).add(key, delta)
            self._notify("key", job, generation, key)
            return value

    def kv_compare_set(
        self, job: str, generation: int, key: str, expected: bytes | None, desired: bytes
    ) -> tuple[bool, bytes | None]:
        with self.lock:
            swapped, current = self.space(job, generation).compare_set(key, expected, desired)
            if swapped:
                self._notify("key", job, generation, key)
            return swapped, current

    def kv_delete(self, job: str, generation: int, key: str) -> bool:
        with self.lock:
            existed = self.space(job, generation).delete(key)
            if existed:
                self._mark_kv(job, key)
            return existed

    def kv_missing(self, job: str, generation: int, keys: list[str]) -> list[str]:
        """The keys not set yet (validates them all)."""
        with self.lock:
            if not keys:
                raise InvalidArgument("wait needs at least one key")
            return self.space(job, generation).missing(keys)

    def barrier_arrive(self, job: str, generation: int, name: str, world_size: int, arrival: str) -> bool:
        """Record an arrival; returns whether the barrier is complete."""
        with self.lock:
            done = self.space(job, generation).arrive(name, world_size, arrival).done
            self._mark_barrier(job, name)
            if done:
                self._notify("barrier", job, generation, name)
            return done

    def barrier_done(self, job: str, generation: int, name: str) -> bool:
        with self.lock:
            return self.space(job, generation).barrier(name).done
