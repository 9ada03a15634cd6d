"""Pipeline schedules as pure functions: each rank's ordered list of forward and backward actions.

The model is cut into `size * virtual_stages` contiguous stages; stage `s` lives on group rank
`s % size` as that rank's chunk `s // size` (Megatron's layout), so with one chunk per rank,
rank r owns stage r. A schedule only orders work: `Pipeline` executes the lists, receiving each
input from the rank that produced it, so any order that the dataflow can satisfy is deadlock-free
(the schedule tests simulate exactly that, without sockets).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Literal

ActionKind = Literal["F", "B"]


class PipelineSchedule(Enum):
    """The order in which each rank runs its microbatches' forwards and backwards."""

    GPIPE = "gpipe"
    """Every forward, then every backward: simple, but all M microbatches' activations are stashed at once."""
    ONE_F_ONE_B = "1f1b"
    """PipeDream-flush: P - r - 1 warm-up forwards on rank r, then one forward / one backward, then the rest
    of the backwards; at most P - r activations stashed."""
    INTERLEAVED_1F1B = "interleaved_1f1b"
    """Megatron's interleaved 1F1B over v model chunks per rank (smaller bubble); needs M divisible by P."""


@dataclass(frozen=True)
class Action:
    """One step of a rank's schedule: forward ("F") or backward ("B") of `microbatch` through local `chunk`."""

    kind: ActionKind
    microbatch: int
    chunk: int

    def stage(self, rank: int, size: int) -> int:
        """Global stage index of this action on group rank `rank` of a `size`-rank pipeline."""
        return self.chunk * size + rank


def stage_rank(stage: int, size: int) -> int:
    """Group rank that owns global `stage`."""
    return stage % size


def stage_chunk(stage: int, size: int) -> int:
    """Local chunk index of global `stage` on its rank."""
    return stage // size


def validate(schedule: PipelineSchedule, size: int, num_microbatches: int, virtual_stages: int) -> None:
    """Raise a ValueError naming the values if this schedule cannot run with them."""
    if not isinstance(schedule, PipelineSchedule):
        raise TypeError(f"schedule must be a PipelineSchedule, got {schedule!r}")
    if size < 1:
        raise ValueError(f"a pipeline needs at least one rank, got size={size}")
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")
    if virtual_stages < 1:
        raise ValueError(f"virtual_stages must be >= 1, got {virtual_stages}")
    if schedule is PipelineSchedule.INTERLEAVED_1F1B:
        if num_microbatches % size:
            raise ValueError(
                f"INTERLEAVED_1F1B needs num_microbatches divisible by the pipeline size: got "
                f"num_microbatches={num_microbatches} with {size} ranks; use a multiple of {size} "
                f"(e.g. {size * max(1, round(num_microbatches / size))}) or ONE_F_ONE_B"
            )
    elif virtual_stages != 1:
        raise ValueError(
            f"{schedule.name} runs one stage per rank, got virtual_stages={virtual_stages}; "
            f"use PipelineSchedule.INTERLEAVED_1F1B for several chunks per rank"
        )


def rank_actions(schedule: PipelineSchedule, rank: int, size: int, num_microbatches: int,
                 virtual_stages: int = 1) -> list[Action]:
    """The ordered actions of group rank `rank`: one F and one later B per (microbatch, local chunk)."""
    validate(schedule, size, num_microbatches, virtual_stages)
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} is outside a pipeline of {size} ranks")
    if schedule is PipelineSchedule.GPIPE:
        return _gpipe(num_microbatches)
    if schedule is PipelineSchedule.ONE_F_ONE_B:
        return _one_f_one_b(rank, size, num_microbatches)
    return _interleaved(rank, size, num_microbatches, virtual_stages)


def forward_actions(schedule: PipelineSchedule, rank: int, size: int, num_microbatches: int,
                    virtual_stages: int = 1) -> list[Action]:
    """The forwards of `rank_actions` in the same order (inference: forwards only depend on forwards)."""
    actions = rank_actions(schedule, rank, size, num_microbatches, virtual_stages)
    return [a for a in actions if a.kind == "F"]


def peak_in_flight(actions: list[Action]) -> int:
    """Most forwards whose backward has not run yet, i.e. the peak number of stashed activations."""
    live = peak = 0
    for a in actions:
        live += 1 if a.kind == "F" else -1
        peak = max(peak, live)
    return peak


def _gpipe(m: int) -> list[Action]:
    return [Action("F", i, 0) for i in range(m)] + [Action("B", i, 0) for i in range(m)]


def _one_f_one_b(rank: int, size: int, m: int) -> list[Action]:
    warmup = min(size - rank - 1, m)
    out = [Action("F", i, 0) for i in range(warmup)]
    for i in range(m - warmup):
        out.append(Action("F", warmup + i, 0))
        out.append(Action("B", i, 0))
    out.extend(Action("B", i, 0) for i in range(m - warmup, m))
    return out


def _interleaved(rank: int, size: int, m: int, v: int) -> list[Action]:
    """Megatron-LM's `forward_backward_pipelining_with_interleaving` order, v chunks per rank.

    The k-th virtual forward runs microbatch (k // (P v)) * P + k % P through chunk (k // P) % v:
    groups of P microbatches go through chunk 0, then chunk 1, ...; backwards mirror it from the
    last chunk. Rank r first runs 2 (P - r - 1) + (v - 1) P forwards (all of them when M == P).
    """
    total = m * v
    group = size * v
    if m == size:
        warmup = total
    else:
        warmup = min((size - rank - 1) * 2 + (v - 1) * size, total)

    def micro(k: int) -> int:
        return (k // group) * size + k % size

    def chunk(k: int, forward: bool) -> int:
        c = (k % group) // size
        return c if forward else v - 1 - c

    out = [Action("F", micro(k), chunk(k, True)) for k in range(warmup)]
    for i in range(total - warmup):
        k = warmup + i
        out.append(Action("F", micro(k), chunk(k, True)))
        out.append(Action("B", micro(i), chunk(i, False)))
    out.extend(Action("B", micro(k), chunk(k, False)) for k in range(total - warmup, total))
    return out
