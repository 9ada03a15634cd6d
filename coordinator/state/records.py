"""The coordinator's objects as JSON-able records and back.

Times: monotonic clocks do not survive a restart, so a finished job's time is kept as wall-clock
seconds; liveness is not kept at all (a restored node gets one lease period from the restart).
"""

from __future__ import annotations

import time
from typing import Any

from axond.coordinator.state.jobs import Event, EventLog, FinishedEvent, InfoEvent, Job, JobSpec, JobState, OutputEvent
from axond.coordinator.state.kv_space import BarrierState
from axond.coordinator.state.membership import Node
from axond.coordinator.state.port import Record
from axond.coordinator.state.rendezvous import Member, Round


def node_record(n: Node) -> Record:
    return {"node_id": n.node_id, "hostname": n.hostname, "seq": n.seq, "slots": n.slots, "daemon": n.daemon,
            "secret": n.secret, "job": n.job, "dead": n.dead, "interval": n.interval}


def node_from(r: Record, now: float) -> Node:
    return Node(r["node_id"], r["hostname"], int(r["seq"]), int(r["slots"]), bool(r["daemon"]), now,
                dead=bool(r["dead"]), job=r["job"], secret=r["secret"], interval=float(r.get("interval", 0.0)))


def joiner_row(rnd: Round, node_id: str) -> list[Any] | None:
    """A joiner of `rnd` as stored apart from its job's record ([hostname, seq, nproc]); None if it left."""
    j = rnd.joiners.get(node_id)
    return None if j is None else [j.order_key[0], j.order_key[1], j.nproc]


def past_round_record(rnd: Round) -> Record:
    """An archived round (it no longer changes), stored once apart from its job's record."""
    return _round_record(rnd)


def _round_record(rnd: Round, joiners: bool = True) -> Record:
    """`joiners` False: without the joiners (the current round's are stored a row each, see `JoinerChanges`)."""
    r: Record = {
        "generation": rnd.generation, "min_nodes": rnd.min_nodes, "max_nodes": rnd.max_nodes,
        "settle_time": rnd.settle_time, "secret": rnd.secret.hex(),
        "members": None if rnd.members is None
        else [[m.node_id, m.hostname, m.nproc, m.node_rank, m.rank_offset] for m in rnd.members],
    }
    if joiners:
        r["joiners"] = [[nid, j.order_key[0], j.order_key[1], j.nproc] for nid, j in rnd.joiners.items()]
    return r


def _round_from(r: Record, now: float, joiners: list[tuple[str, list[Any]]] | None = None) -> Round:
    """`joiners`: the round's joiner rows, for a record written without them (no "joiners" key)."""
    rnd = Round(int(r["generation"]), int(r["min_nodes"]), int(r["max_nodes"]), float(r["settle_time"]),
                bytes.fromhex(r["secret"]))
    inline = r.get("joiners")
    rows = [(nid, [host, seq, nproc]) for nid, host, seq, nproc in inline] if inline is not None else joiners or []
    for node_id, (host, seq, nproc) in rows:
        rnd.add(node_id, (host, int(seq)), int(nproc), now)
    rnd.dirty.clear()
    if r["members"] is not None:
        rnd.members = [Member(nid, host, int(nproc), int(nr), int(off)) for nid, host, nproc, nr, off in r["members"]]
        rnd._by_node = {m.node_id: m for m in rnd.members}
    return rnd


def _wall(at: float | None, now: float) -> float | None:
    return None if at is None else time.time() - (now - at)


def _mono(at: float | None, now: float) -> float | None:
    return None if at is None else now - max(0.0, time.time() - at)


def job_record(j: Job, now: float) -> Record:
    spec = j.spec
    return {
        "name": j.name, "min_nodes": j.min_nodes, "max_nodes": j.max_nodes, "max_restarts": j.max_restarts,
        "state": int(j.state), "restarts": j.restarts, "reason": j.reason, "exit_code": j.exit_code,
        "spec": None if spec is None else {
            "nnodes": spec.nnodes, "nproc_per_node": spec.nproc_per_node, "argv": list(spec.argv),
            "env": [list(kv) for kv in spec.env], "max_restarts": spec.max_restarts, "cwd": spec.cwd,
            "min_nodes": spec.min_nodes, "live_recovery": spec.live_recovery},
        "assigned": list(j.assigned), "exits": dict(j.exits), "placement_note": j.placement_note,
        "finished_wall": _wall(j.finished_at, now), "round": _round_record(j.round, joiners=False),
        "past_generations": [r.generation for r in j.past_rounds], "events_base": j.events.base,
        "live": j.live, "live_generation": j.live_generation, "left": list(j.left),
    }


def job_from(r: Record, now: float, events: EventLog, joiners: list[tuple[str, list[Any]]] | None = None,
             past: dict[int, Record] | None = None) -> Job:
    """`joiners`: the current round's joiner rows (ignored for a record that holds its joiners itself);
    `past`: its past rounds' records by generation (for a record that lists only their generations)."""
    s = r["spec"]
    spec = None if s is None else JobSpec(int(s["nnodes"]), int(s["nproc_per_node"]), tuple(s["argv"]),
                                          tuple((k, v) for k, v in s["env"]), int(s["max_restarts"]), s["cwd"],
                                          int(s.get("min_nodes", 0)), bool(s.get("live_recovery", False)))
    rnd = _round_from(r["round"], now, joiners)
    return Job(
        r["name"], int(r["min_nodes"]), int(r["max_nodes"]), int(r["max_restarts"]), rnd,
        state=JobState(int(r["state"])), restarts=int(r["restarts"]), reason=r["reason"], exit_code=r["exit_code"],
        spec=spec, assigned=list(r["assigned"]), exits={k: int(v) for k, v in r["exits"].items()},
        placement_note=r["placement_note"], past_rounds=[_round_from(p, now) for p in _past(r, past or {})],
        finished_at=_mono(r["finished_wall"], now), events=events,
        live=bool(r.get("live", False)), live_generation=int(r.get("live_generation", 0)),
        left=[str(n) for n in r.get("left", [])],
    )


def _past(r: Record, past: dict[int, Record]) -> list[Record]:
    if "past_rounds" in r:  # a record from before past rounds were stored apart
        return list(r["past_rounds"])
    missing = [g for g in r["past_generations"] if g not in past]
    if missing:
        raise ValueError(f"job {r['name']!r}: the records of its past generations {missing} are missing")
    return [past[g] for g in r["past_generations"]]


def event_record(e: Event) -> Record:
    if isinstance(e, OutputEvent):
        return {"kind": "output", "rank": e.rank, "stream": e.stream, "text": e.text}
    if isinstance(e, InfoEvent):
        return {"kind": "info", "text": e.text}
    return {"kind": "finished", "exit_code": e.exit_code, "message": e.message}


def event_from(r: Record) -> Event:
    if r["kind"] == "output":
        return OutputEvent(int(r["rank"]), r["stream"], r["text"])
    if r["kind"] == "info":
        return InfoEvent(r["text"])
    return FinishedEvent(int(r["exit_code"]), r["message"])


def barrier_record(b: BarrierState) -> Record:
    return {"world_size": b.world_size, "arrivals": sorted(b.arrivals)}


def barrier_from(r: Record) -> BarrierState:
    return BarrierState(int(r["world_size"]), set(r["arrivals"]))


def scheduler_meta(queue: list[str], deliveries: dict[str, list[str]], cancels: dict[str, list[str]],
                   job_seq: int, node_seq: int) -> Record:
    return {"queue": list(queue), "deliveries": {k: list(v) for k, v in deliveries.items()},
            "cancels": {k: list(v) for k, v in cancels.items()}, "job_seq": job_seq, "node_seq": node_seq}

