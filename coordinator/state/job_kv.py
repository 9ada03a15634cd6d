"""The store calls of every job: each scoped to the job's current generation and its KV space."""

from __future__ import annotations

from axond.coordinator.state.context import StateContext
from axond.coordinator.state.errors import FailedPrecondition, InvalidArgument, short
from axond.coordinator.state.kv_space import KvSpace


class JobKv:
    """Keys and barriers by (job, generation); stale generations are refused (plain; the caller holds the lock)."""

    def __init__(self, ctx: StateContext) -> None:
        self.ctx = ctx

    def space(self, job: str, generation: int) -> KvSpace:
        """The KV space of the job's current generation; stale or unknown generations are refused."""
        j = self.ctx.job(job)
        if generation > j.generation or generation < 1:
            raise InvalidArgument(f"generation {generation} of job {short(job)} does not exist (current {j.generation})")
        if generation < j.generation or j.state.terminal:
            why = f": {j.reason[:300]}" if j.reason else ""
            raise FailedPrecondition(
                f"generation {generation} of job {short(job)} is over (now {j.generation}, {j.state.name}{why}); "
                "the job restarted or finished, so ranks of the old generation must exit"
            )
        return j.kv

    def set(self, job: str, generation: int, key: str, value: bytes) -> None:
        self.space(job, generation).set(key, value)
        self.ctx.notify("key", job, generation, key)

    def get(self, job: str, generation: int, key: str) -> bytes | None:
        return self.space(job, generation).get(key)

    def add(self, job: str, generation: int, key: str, delta: int, request_id: str = "") -> int:
        space = self.space(job, generation)
        if request_id:
            answer = space.answer_of(request_id)
            if answer is not None:  # a retry of an add that happened: its first answer, nothing added again
                return int(answer)
        value = space.add(key, delta)
        self.ctx.notify("key", job, generation, key)
        if request_id:
            self._keep(job, space, request_id, str(value).encode())
        return value

    def compare_set(
        self, job: str, generation: int, key: str, expected: bytes | None, desired: bytes, request_id: str = ""
    ) -> tuple[bool, bytes | None]:
        space = self.space(job, generation)
        if request_id and space.answer_of(request_id) is not None:
            return True, space.get(key)  # a retry of a swap that happened (a failed one changed nothing: re-run)
        swapped, current = space.compare_set(key, expected, desired)
        if swapped:
            self.ctx.notify("key", job, generation, key)
            if request_id:
                self._keep(job, space, request_id, b"swapped")
        return swapped, current

    def _keep(self, job: str, space: KvSpace, request_id: str, answer: bytes) -> None:
        for changed in space.keep_answer(request_id, answer):
            self.ctx.mark_kv(job, changed)

    def delete(self, job: str, generation: int, key: str) -> bool:
        existed = self.space(job, generation).delete(key)
        if existed:
            self.ctx.mark_kv(job, key)
        return existed

    def missing(self, job: str, generation: int, keys: list[str]) -> list[str]:
        """The keys not set yet (validates them all)."""
        if not keys:
            raise InvalidArgument("wait needs at least one key")
        return self.space(job, generation).missing(keys)

    def arrive(self, job: str, generation: int, name: str, world_size: int, arrival: str) -> bool:
        """Record an arrival at barrier `name`; returns whether the barrier is complete."""
        done = self.space(job, generation).arrive(name, world_size, arrival).done
        self.ctx.mark_barrier(job, name)
        if done:
            self.ctx.notify("barrier", job, generation, name)
        return done

    def barrier_done(self, job: str, generation: int, name: str) -> bool:
        return self.space(job, generation).barrier(name).done
