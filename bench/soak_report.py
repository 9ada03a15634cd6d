"""What a chaos soak (soak_run.py) shows: per fault, the seconds to the first step of the next generation and to the
job's full size again; the stalls between committed steps (a hang is one longer than the bound the configured lease,
fence and re-formation allow); every step's parameters against a fault-free replay of the same virtual ranks; and
goodput, counted from the ranks' step logs and as the coordinator's book says.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from axond.fencing import fence_wait
from axond.testing import run_threads
from axond.train import Callback, DistributedTrainer
from recovery import cell
from soak_run import FULL, Fault, SoakConfig, SoakRun
from soak_train import EPOCHS, build_trainer, params_hash

DETECT_S = 0.5
"""Beyond the lease: the coordinator's tick, the survivors' next heartbeat and the rank's watcher (live recovery's
promise for a node lost by its lease; docs/live-recovery.md)."""
REFORM_S = 5.0
"""Allowed for re-forming the group and agreeing on the step (or moving the state to a joining rank), on a busy
machine: the issue's figure is 2 s."""


def hang_bound(c: SoakConfig) -> float:
    """The longest wait without a committed step that is not a hang: a node lost by its lease (lease, detection,
    the fence, one heartbeat) plus a re-formation. A real hang lasts the group's timeout (30 s) or more."""
    return c.lease + DETECT_S + fence_wait(c.lease, c.heartbeat, c.fence_margin) + c.heartbeat + REFORM_S


@dataclass
class FaultOutcome:
    fault: Fault
    first_step: float | None
    """Seconds from the fault to the first committed step of a later generation."""
    full_size: float | None
    """Seconds from the fault to the first committed step at full size in a later generation."""
    stall: float
    """The longest wait between two committed steps from the fault to its first step after."""
    errors: tuple[float, ...] = ()
    """Seconds from the fault to each survivor's `MembershipChanged` (its first re-formation after the fault)."""
    reformed: tuple[float, ...] = ()
    """Seconds from the fault to each survivor's new group formed and the step agreed (computing again)."""
    survivors: tuple[int, ...] = ()
    """The PIDs that were training in the fault's generation, the struck rank's left out."""
    kept: tuple[int, ...] = ()
    """Of `survivors`, those that committed a step in a later generation (the same process kept going)."""
    world_after: int = 0
    """The world size of the first step committed after the fault in a later generation."""


@dataclass
class SoakReport:
    outcomes: list[FaultOutcome]
    steps: int
    hangs: list[tuple[int, float]]
    """(step, seconds without a committed step before it) above the hang bound."""
    bound: float
    divergences: list[tuple[int, int, str, str]]
    """(pid, step, its hash, the replay's) that differ."""
    order_errors: list[str]
    """A process whose steps were not 1, 2, 3 ... (a step lost or applied twice)."""
    goodput: float
    productive: float
    wall: float
    coordinator: dict[str, Any] = field(default_factory=dict)
    processes: int = 0
    transfers: int = 0
    final_losses: list[float] = field(default_factory=list)
    """`--torch`: each rank's loss over the whole data set at the end."""
    reference_loss: float | None = None
    """`--torch`: the fault-free run's, after as many steps."""
    worst_step: float = 0.0
    """`--torch`: the largest relative difference of a step's loss from the fault-free run's."""
    join_waits: list[tuple[int, float]] = field(default_factory=list)
    """`--torch`: (step, seconds) of the waits above the hang bound that ended when a rank joined (the running ranks
    waited for the new rank's process to start: its interpreter and `import torch`), kept apart from `hangs`."""
    from_storage: int = 0
    """Re-formations whose state came from a checkpoint on storage (`Recovery.checkpoint`), not from memory."""


LOSS_RTOL = 1e-5
"""`--torch`: the issue's bound on the loss against a fault-free run (DDP sums in its own order: not bit for bit)."""


def torch_reference(c: SoakConfig, steps: int) -> tuple[list[float], float]:
    from soak_train_torch import reference

    return reference(c.hidden, steps)


def _far(got: float, want: float) -> bool:
    return abs(got - want) > LOSS_RTOL * abs(want)


class _Stop(Exception):
    pass


class _Replay(Callback):
    def __init__(self, stop: int) -> None:
        self.stop, self.hashes = stop, [""]

    def on_step_end(self, trainer: DistributedTrainer, metrics: dict[str, float]) -> None:
        self.hashes.append(params_hash(trainer))
        if int(metrics["global_step"]) >= self.stop:
            raise _Stop


def replay(c: SoakConfig, steps: int) -> list[str]:
    """The parameters' digest after each of `steps` steps (index = global step) of one process training the same
    four virtual ranks with no fault."""
    ref = _Replay(steps)

    def body(group: Any) -> None:
        try:
            build_trainer(group, [ref], c.hidden, c.parallel, virtual_ranks=FULL).fit(EPOCHS)
        except _Stop:
            pass
    run_threads(body, 1, timeout=3600.0)
    return ref.hashes


def _lines(run: SoakRun) -> dict[int, list[dict[str, Any]]]:
    by_pid = {}
    for path in run.out.glob("steps-*.jsonl"):
        by_pid[int(path.stem.removeprefix("steps-"))] = [json.loads(x) for x in path.read_text().splitlines() if x]
    return by_pid


def _outcome(f: Fault, by_pid: dict[int, list[dict[str, Any]]], steps: list[dict[str, Any]],
             pairs: list[tuple[float, float]]) -> FaultOutcome:
    """What followed one fault: the survivors' errors and re-formations, the first step of a later generation (its
    world size), whether the processes training when it struck (the struck rank's left out) kept going, full size
    again, the longest stall."""
    after = sorted((s["mono"], s["world"]) for s in steps if s["gen"] > f.gen and s["mono"] > f.at)
    first = after[0][0] - f.at if after else None
    full = next((t - f.at for t, w in after if w == FULL), None)
    until = f.at + (first if first is not None else 0.0)
    stall = max((b - a for a, b in pairs if b > f.at and a < until), default=0.0)
    survivors, kept, errors, reformed = [], [], [], []
    for pid, lines in sorted(by_pid.items()):
        if pid == f.pid or not any(x["kind"] == "step" and x["gen"] == f.gen and x["mono"] <= f.at for x in lines):
            continue
        survivors.append(pid)
        if any(x["kind"] == "step" and x["gen"] > f.gen and x["mono"] > f.at for x in lines):
            kept.append(pid)
        first_recovery = min((x for x in lines if x["kind"] == "recovery" and x["error_at"] > f.at),
                             key=lambda x: x["error_at"], default=None)
        if first_recovery is not None:
            errors.append(first_recovery["error_at"] - f.at)
            reformed.append(first_recovery["reformed_at"] - f.at)
    return FaultOutcome(f, first, full, stall, tuple(errors), tuple(reformed), tuple(survivors), tuple(kept),
                        after[0][1] if after else 0)


def analyse(run: SoakRun, reference: list[str] | None = None) -> SoakReport:
    c = run.config
    by_pid = _lines(run)
    steps = [x for lines in by_pid.values() for x in lines if x["kind"] == "step"]
    recoveries = [x for lines in by_pid.values() for x in lines if x["kind"] == "recovery"]
    ends: dict[int, float] = {}
    for s in steps:
        ends[s["step"]] = max(ends.get(s["step"], 0.0), s["mono"])
    last = max(ends) if ends else 0
    final_losses: list[float] = []
    reference_loss, worst = None, 0.0
    if c.torch:  # each step's loss (the mean over the virtual ranks) and the final loss, against the fault-free run
        ref_losses, reference_loss = torch_reference(c, last)
        divergences = [(pid, s["step"], f"{s['loss']:.9g}", f"{ref_losses[s['step']]:.9g}")
                       for pid, lines in by_pid.items() for s in lines
                       if s["kind"] == "step" and s["loss"] is not None and _far(s["loss"], ref_losses[s["step"]])]
        worst = max((abs(s["loss"] - ref_losses[s["step"]]) / abs(ref_losses[s["step"]]) for s in steps
                     if s["loss"] is not None and ref_losses[s["step"]]), default=0.0)
        for path in run.out.glob("end-*.json"):
            end = json.loads(path.read_text())
            if end["step"] == last:
                final_losses.append(end["final_loss"])
    else:
        reference = reference if reference is not None else replay(c, last)
        divergences = [(pid, s["step"], s["hash"], reference[s["step"]]) for pid, lines in by_pid.items()
                       for s in lines if s["kind"] == "step" and s["hash"] != reference[s["step"]]]
    order_errors = []
    for pid, lines in by_pid.items():
        seq = [s["step"] for s in lines if s["kind"] == "step"]
        if seq and seq != list(range(seq[0], seq[0] + len(seq))):
            order_errors.append(f"pid {pid}: steps {seq[:3]}...{seq[-3:]} are not consecutive")
    reformed = sorted(r["reformed_at"] for r in recoveries)
    joined_at = {x["step"] for lines in by_pid.values() for x in lines if x["kind"] == "transfer"}
    # goodput: each committed step's attempt, from the end of the step before (or the last re-formation since)
    start = run.first_full
    productive, hangs, join_waits = 0.0, [], []
    bound = hang_bound(c)
    for k in range(2, last + 1):
        if k not in ends or k - 1 not in ends or ends[k] <= start:
            continue
        prev = max(ends[k - 1], start)
        begin = max([prev] + [t for t in reformed if prev < t < ends[k]])
        productive += ends[k] - begin
        if ends[k] - ends[k - 1] > bound and ends[k - 1] >= start:
            (join_waits if c.torch and {k - 1, k} & joined_at else hangs).append((k, ends[k] - ends[k - 1]))
    wall = max(ends.values()) - start if ends else 0.0
    pairs = [(ends[k - 1], ends[k]) for k in range(2, last + 1) if k in ends and k - 1 in ends]
    outcomes = [_outcome(f, by_pid, steps, pairs) for f in run.faults]
    coordinator = run.statuses[-1] if run.statuses else {}
    transfers = sum(1 for lines in by_pid.values() for x in lines if x["kind"] == "transfer" and x["received"])
    return SoakReport(outcomes, last, hangs, bound, divergences, order_errors, productive / wall if wall else 0.0,
                      productive, wall, coordinator, len(by_pid), transfers, final_losses, reference_loss, worst,
                      join_waits, sum(1 for r in recoveries if r.get("checkpoint")))


def table(report: SoakReport, run: SoakRun) -> str:
    c = run.config
    what = "torch DDP over \"axond\" (`axond.torch.live.Manager`)" if c.torch else f"`{c.parallel}`"
    rows = [f"four namespace hosts, one rank each, `--nnodes {c.min_nodes}:{FULL}`, {what} on an MLP of width "
            f"{c.hidden}; one fault every {c.period:g} s for {c.duration:g} s (seed {c.seed}), SIGSTOP and DROP held "
            f"{c.hold:g} s; lease {c.heartbeat:g} s x {c.missed} = {c.lease:g} s, fence margin {c.fence_margin:g} s; "
            "seconds from the fault, median (min-max)", "",
            "| fault | count | first step of the next generation | full size again | longest stall |",
            "|---|---:|---:|---:|---:|"]
    for kind in c.faults:
        got = [o for o in report.outcomes if o.fault.kind == kind]
        rows.append(f"| {kind} | {len(got)} | {cell([o.first_step for o in got if o.first_step is not None])} | "
                    f"{cell([o.full_size for o in got if o.full_size is not None])} | "
                    f"{cell([o.stall for o in got])} |")
    missing = [o for o in report.outcomes if o.first_step is None or o.full_size is None]
    parts = report.coordinator.get("parts", {})
    cwall = report.coordinator.get("wall_s", 0.0)
    cgood = f"{parts.get('productive', 0.0) / cwall:.1%}" if cwall else "-"
    lost = ", ".join(f"{k} {v:.1f} s" for k, v in sorted(parts.items()) if k != "productive" and v)
    rows += ["", "| fault | host (pid) | survivors' error | re-formed, step agreed | first step after (world) | "
             "survivors that kept their PIDs and trained on |", "|---|---|---:|---:|---:|---:|"]
    for o in report.outcomes:
        f = o.fault
        rows.append(f"| {f.kind} | {f.host} ({f.pid}) | {cell(list(o.errors))} | {cell(list(o.reformed))} | "
                    f"{'-' if o.first_step is None else f'{o.first_step:.2f}'} ({o.world_after}) | "
                    f"{len(o.kept)} of {len(o.survivors)} |")
    rows += ["", "| measure | value |", "|---|---:|",
             f"| steps committed | {report.steps} |",
             f"| rank processes (4 first + replacements) | {report.processes} |",
             f"| states taken from a live peer | {report.transfers} |",
             f"| faults with no step after / not back at full size | {sum(o.first_step is None for o in missing)} / "
             f"{sum(o.full_size is None for o in missing)} |",
             f"| workers started again by the soak | {len(run.respawned)} |",
             f"| hangs (no committed step for > {report.bound:.2f} s) | {len(report.hangs)} |",
             f"| waits above that ended as a rank joined (its process starting) | {len(report.join_waits)}"
             f"{' (' + cell([w for _, w in report.join_waits]) + ' s)' if report.join_waits else ''} |",
             f"| longest wait between committed steps | {max((o.stall for o in report.outcomes), default=0):.2f} s |",
             (f"| steps whose loss differs from a fault-free run's by > {LOSS_RTOL:g} relative (largest "
              f"difference) | {len(report.divergences)} ({report.worst_step:.1e}) |" if c.torch else
              f"| hash divergences (step logs vs a fault-free replay) | {len(report.divergences)} |"),
             f"| steps lost or applied twice | {len(report.order_errors)} |",
             f"| re-formations that read a checkpoint from storage | {report.from_storage} |",
             f"| goodput, steps' time over wall time (from full size to the end) | {report.goodput:.1%} "
             f"({report.productive:.1f} of {report.wall:.1f} s) |",
             f"| goodput, coordinator's book (from the job's creation) | {cgood} of {cwall:.1f} s ({lost}) |",
             f"| workers' exit codes at the end | {run.exit_codes} |"]
    if c.torch and report.reference_loss is not None:
        worst = max((abs(x - report.reference_loss) / abs(report.reference_loss) for x in report.final_losses),
                    default=float("nan"))
        rows += [f"| final loss, fault-free run (step {report.steps}) | {report.reference_loss:.9g} |",
                 f"| final loss of the {len(report.final_losses)} ranks at the end | "
                 f"{', '.join(f'{x:.9g}' for x in sorted(set(report.final_losses)))} |",
                 f"| largest relative difference | {worst:.2e} |"]
    return "\n".join(rows)
