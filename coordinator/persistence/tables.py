"""The committed records as plain dicts: how a `Changes` applies, shared by both implementations."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from axond.coordinator.state.port import Changes, Record, Snapshot


@dataclass
class Tables:
    nodes: dict[str, Record] = field(default_factory=dict)
    jobs: dict[str, Record] = field(default_factory=dict)
    kv: dict[tuple[str, str], tuple[int, bytes]] = field(default_factory=dict)
    barriers: dict[tuple[str, str], tuple[int, Record]] = field(default_factory=dict)
    events: dict[str, dict[int, Record]] = field(default_factory=dict)
    meta: Record | None = None
    past_rounds: dict[tuple[str, int], Record] = field(default_factory=dict)
    joiners: dict[str, tuple[int, dict[str, list[Any]]]] = field(default_factory=dict)
    """job -> (its round's generation, node id -> [hostname, seq, nproc] in the round's order)."""

    def apply(self, c: Changes) -> None:
        for node_id in c.deleted_nodes:
            self.nodes.pop(node_id, None)
        self.nodes.update(copy.deepcopy(c.nodes))
        for job in c.deleted_jobs | c.cleared_stores:
            for table in (self.kv, self.barriers):
                for k in [k for k in table if k[0] == job]:
                    del table[k]
        for job in c.deleted_jobs:
            self.jobs.pop(job, None)
            self.events.pop(job, None)
            self.joiners.pop(job, None)
            for past in [past for past in self.past_rounds if past[0] == job]:
                del self.past_rounds[past]
        self.jobs.update(copy.deepcopy(c.jobs))
        for job, rounds in c.past_rounds.items():
            for gen, rec in rounds.items():
                if rec is None:
                    self.past_rounds.pop((job, gen), None)
                else:
                    self.past_rounds[(job, gen)] = copy.deepcopy(rec)
        for job, jc in c.joiners.items():
            gen, rows = self.joiners.get(job, (jc.generation, {}))
            if jc.reset or gen != jc.generation:
                rows = {}
            for node_id, row in jc.rows.items():
                if row is None:
                    rows.pop(node_id, None)
                else:
                    rows[node_id] = list(row)
            self.joiners[job] = (jc.generation, rows)
        for k, (gen, value) in c.kv.items():
            if value is None:
                self.kv.pop(k, None)
            else:
                self.kv[k] = (gen, value)
        self.barriers.update(copy.deepcopy(c.barriers))
        for job, (first, events) in c.events.items():
            log = self.events.setdefault(job, {})
            for i, event in enumerate(events):
                log[first + i] = dict(event)
            base = int(self.jobs.get(job, {}).get("events_base", 0))
            for index in [i for i in log if i < base]:
                del log[index]
        if c.meta is not None:
            self.meta = copy.deepcopy(c.meta)

    def snapshot(self) -> Snapshot:
        return Snapshot(
            nodes=copy.deepcopy(list(self.nodes.values())),
            jobs=copy.deepcopy(list(self.jobs.values())),
            kv=[(job, gen, key, value) for (job, key), (gen, value) in self.kv.items()],
            barriers=[(job, gen, name, copy.deepcopy(rec)) for (job, name), (gen, rec) in self.barriers.items()],
            events={job: (min(log, default=0), [log[i] for i in sorted(log)]) for job, log in self.events.items()},
            meta=copy.deepcopy(self.meta),
            joiners=[(job, gen, node_id, list(row)) for job, (gen, rows) in self.joiners.items()
                     for node_id, row in rows.items()],
            past_rounds=[(job, gen, copy.deepcopy(rec)) for (job, gen), rec in self.past_rounds.items()],
        )
