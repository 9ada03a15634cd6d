"""The torchrun-like agent: rendezvous, start the local ranks, watch them, restart the generation.

`JobRunner` is one node's part in one job (used both by `axond worker -- CMD` and by the daemon);
`axond.worker.node` registers a node, starts its heartbeats and runs a `JobRunner` in a thread.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

import grpc

from axond.errors import CoordinatorError, StoreError
from axond.fencing import PROBE_TIMEOUT_S
from axond.v1 import coordinator_pb2 as pb
from axond.worker.heartbeat import Heartbeater
from axond.worker.blame import caused_elsewhere
from axond.worker.blame import describe as describe_failure
from axond.worker.background import Background
from axond.worker.causes import blocked_reader
from axond.worker.frozen import FrozenWatch
from axond.worker.launcher import CAUSE_GRACE_S, LocalRanks, OutputSink, RankSpec, print_sink
from axond.worker.launcher import start_ranks
from axond.worker.error_files import remove_scratch, scratch_dir
from axond.worker import live
from axond.worker.joinback import JoinNotice, rejoin_after_left, report_when_back
from axond.worker.linkcheck import LinkCheck
from axond.worker.outage import OutageGuard
from axond.worker.outcome import (  # noqa: F401 -- re-exported: what callers of the runner read
    JOB_FAILED_ELSEWHERE_EXIT_CODE, LEASE_LOST_EXIT_CODE, TERMINAL_STATES, JobOutcome, Notice, notice_to_stderr,
    stderr_notice,
)
from axond.worker.reports import MONITOR_TICK_S, Reports, tell_accused
from axond.worker.peers import PeerLink, advertised_host
from axond.worker.rank_specs import rank_specs
from axond.worker.shard_memory import ShardMemory
from axond.worker.progress import EarlyExitWatch, JoinProgress
from axond.worker.stragglers import StragglerWatch, arrivals_reader
from axond.worker.spec import ConnectOptions, JobSpec
from axond.worker.stack_answers import StackAnswers
from axond.worker.stacks import rank_stacks
from axond.worker.torch_env import AgentStore

if TYPE_CHECKING:
    from axond.control.client import CoordinatorClient


READ_TIMEOUT_S = 1.0
"""Seconds one read of the ranks' reports (blocked ops, arrival windows) may take: a read in flight when the
coordinator becomes unreachable ends this soon, and its thread with it."""


class JobRunner:
    """Runs one node's ranks of `spec`, generation after generation, until success or failure."""

    def __init__(
        self,
        client: CoordinatorClient,
        conn: ConnectOptions,
        node_id: str,
        heartbeater: Heartbeater,
        spec: JobSpec,
        sink: OutputSink = print_sink,
        notice: Notice = stderr_notice,
        flush: Callable[[], None] | None = None,
        progress_every: float = 0.0,
    ) -> None:
        """`flush`, if given, is called before each exit or failure report, so that output sent
        elsewhere (daemon mode) reaches the coordinator before the job's end does. `progress_every` > 0:
        say every that many seconds how far the rendezvous got while this node waits in it."""
        self._progress_every = progress_every
        self._error_dir: str | None = None
        self._flush = flush or (lambda: None)
        self._client = client
        self._conn = conn
        self._node_id = node_id
        self._hb = heartbeater
        self._spec = spec
        self._sink = sink
        self._notice = notice
        self._stop = threading.Event()
        self._stop_code = 1
        self._stop_reason = ""
        self.joining = threading.Event()
        self._kept: LocalRanks | None = None
        """Live recovery: the ranks kept running into the next generation, while this node re-joins."""
        self._live_reason = ""
        self._joins: JoinNotice | None = None
        """Live recovery: says whether this node's fresh ranks joined a running job (`axond.worker.joinback`)."""
        self._rejoins = False
        """Live recovery went on without this node and its worker joins the job again (one restart counted)."""
        self._restarts_left = 0
        self._shards = ShardMemory()
        self._reports = Reports(client, node_id, spec, heartbeater, self._stop, notice)
        """Live recovery: the memory kept for each local rank (its ZeRO-1 copies outlive it), freed at the run's end."""

    def request_stop(self, exit_code: int, reason: str) -> None:
        """Ask the runner to stop its ranks and return `exit_code` (from any thread)."""
        if not self._stop.is_set():
            self._stop_code, self._stop_reason = exit_code, reason
            self._stop.set()
            self._hb.changed.set()

    @property
    def job(self) -> str:
        """Name of the job this runner runs."""
        return self._spec.job

    def run(self) -> JobOutcome:
        """Join, run and restart until the job ends for this node; never raises CoordinatorError."""
        spec = self._spec
        first = True
        try:
            while True:
                if self._stop.is_set():
                    return JobOutcome(self._stop_code, self._stop_reason)
                self.joining.set()
                try:
                    with JoinProgress(self._client, spec.job, spec.min_nodes, spec.max_nodes, spec.join_timeout,
                                      self._notice, every=self._progress_every):
                        joined = self._client.join(
                            spec.job, self._node_id, spec.nproc_per_node, spec.min_nodes, spec.max_nodes,
                            max_restarts=spec.max_restarts, timeout=spec.join_timeout,
                            live_recovery=spec.live_recovery,
                        )
                except (CoordinatorError, ValueError) as e:
                    if self._stop.is_set():
                        return JobOutcome(self._stop_code, self._stop_reason)
                    code = getattr(e.__cause__, "code", None)
                    refused = first and callable(code) and code() == grpc.StatusCode.FAILED_PRECONDITION
                    return JobOutcome(1, f"could not join job {spec.job!r}: {e}", error=e, refused=refused)
                finally:
                    self.joining.clear()
                first = False
                outcome = self._run_generation(joined)
                if outcome is not None:
                    return outcome
        finally:
            if self._kept is not None:  # stopped, or refused, while re-joining with its ranks running
                self._kept.stop(grace=spec.stop_grace)
                self._kept = None
            self._hb.untrack(spec.job)
            self._shards.close()
            if self._error_dir is not None:
                remove_scratch(self._error_dir)

    def _error_file(self, generation: int, rank: int) -> str:
        """Where rank `rank` of `generation` writes its uncaught exception (`AXOND_ERROR_FILE`): a private
        directory, removed when the runner ends."""
        if self._error_dir is None:
            self._error_dir = scratch_dir()
        return os.path.join(self._error_dir, f"g{generation}-rank{rank}.json")

    def _membership_paths(self, count: int) -> list[str]:
        """The membership file of each local rank (live recovery; `axond.worker.live`)."""
        if self._error_dir is None:
            self._error_dir = scratch_dir()
        return [live.membership_path(self._error_dir, i) for i in range(count)]

    def _rank_specs(self, joined: pb.JoinResponse, master: str = "") -> list[RankSpec]:
        relay = self._shards.serve(advertised_host(self._client.address, dict(self._spec.env or {}),
                                                   self._conn.env.socket_ifname), joined.job_secret, self._notice) \
            if self._spec.live_recovery else None
        return rank_specs(self._conn, self._spec, self._node_id, joined, master, self._error_file,
                          self._membership_paths(joined.local_world_size), self._shards.fd, relay,
                          self._shards.forward_fd)

    def _run_generation(self, joined: pb.JoinResponse) -> JobOutcome | None:
        """Run one generation; returns the final outcome, or None to re-join the next generation."""
        spec, gen = self._spec, joined.generation
        first, last = joined.rank_offset, joined.rank_offset + joined.local_world_size - 1
        self._notice(
            f"job {spec.job!r} generation {gen}: node rank {joined.node_rank} of {joined.nnodes}, "
            f"ranks {first}..{last} of world size {joined.world_size}, restarts left {joined.restarts_left}"
        )
        if spec.node_rank is not None and spec.node_rank != joined.node_rank:
            self._notice(f"--node-rank {spec.node_rank} was given, but the rendezvous made this node rank "
                         f"{joined.node_rank} (axond orders the nodes by host name); GROUP_RANK and NODE_RANK say "
                         f"{joined.node_rank}")
        self._hb.track(spec.job, gen)
        agent_store = AgentStore(self._conn.env.torch_store)
        try:
            master = agent_store.open(self._client, spec.job, joined, self._conn.address)
        except (CoordinatorError, StoreError, RuntimeError, OSError) as e:
            self._notice(f"job {spec.job!r}: no torch store for the ranks (MASTER_ADDR/MASTER_PORT unset): {e}")
            master = ""
        kept, self._kept = self._kept, None
        self._restarts_left = joined.restarts_left
        self._joins = JoinNotice(spec.job, gen, joined.restarts_left, self._rejoins, self._notice) \
            if spec.live_recovery and kept is None and gen > 1 else None
        self._rejoins = False
        try:
            specs = self._rank_specs(joined, master)
            if kept is None:
                ranks = start_ranks(spec.argv, specs, cwd=spec.cwd, sink=self._sink)
            else:  # live recovery: the same processes take their places in this generation
                ranks = kept
                live.renumber(ranks, joined.rank_offset)
                live.assign(self._membership_paths(joined.local_world_size), joined, self._live_reason)
            self._hb.report_pids(spec.job, ranks.local_pids)
            link: PeerLink | None = None
            reads: CoordinatorClient | None = None
            readers: list[Callable[[float], bool]] = []
            try:
                reads = replace(self._conn, call_timeout=READ_TIMEOUT_S, connect_wait=0.0).connect()
                link = self._peer_link(joined)
                guard = OutageGuard(self._hb, link, spec.outage_grace, self._notice)
                links = LinkCheck(link, self._membership_paths(joined.local_world_size), time.time()) \
                    if spec.live_recovery and joined.nnodes > 1 else None
                return self._monitor(ranks, gen, joined.nnodes, [s.rank for s in specs], guard, joined.world_size,
                                     reads, readers, links)
            finally:
                if reads is not None:
                    reads.close()  # cancels a read still in flight: its thread ends with it
                deadline = time.monotonic() + READ_TIMEOUT_S + 1.0
                for close in readers:  # and no read is left inside gRPC when the process exits (worker/background.py)
                    close(max(0.0, deadline - time.monotonic()))
                if link is not None:
                    link.close()
                if self._kept is not ranks:
                    ranks.stop(grace=spec.stop_grace)
        finally:
            agent_store.close()

    def _peer_link(self, joined: pb.JoinResponse) -> PeerLink | None:
        """This node's listener for its peers' checks during an outage (None if it cannot listen: nothing can then
        vouch for an outage, and it stops its ranks at the lease)."""
        try:
            return PeerLink(self._client, self._spec.job, joined.generation, joined.node_rank, joined.nnodes,
                            joined.job_secret, lambda: self._hb.silent_for, lambda: self._hb.lease,
                            contact_for=lambda: self._hb.contact_for,
                            env=dict(self._spec.env or {}), wait_s=self._spec.join_timeout,
                            ifname=self._conn.env.socket_ifname)
        except OSError as e:
            self._notice(f"cannot listen for the job's other nodes ({e}); without them this node cannot ride out a "
                         "coordinator outage (its ranks stop at the lease)")
            return None

    def _monitor(self, ranks: LocalRanks, gen: int, nnodes: int, local: list[int],
                 guard: OutageGuard, world_size: int, reads: CoordinatorClient,
                 readers: list[Callable[[float], bool]], links: LinkCheck | None = None) -> JobOutcome | None:
        """Watch the ranks until the generation ends; `reads` (a client with short calls) reads what the ranks
        report, off this loop's thread (`Background`): the loop's fencing deadline never waits on the coordinator.
        `readers` receives each reader's `close`, for the caller to call once the generation ended."""
        spec = self._spec
        def stacks(rank: int) -> str:
            pid = dict(zip(local, ranks.local_pids())).get(rank, 0)
            return f"pid {pid}, " + rank_stacks(pid, self._error_file(gen, rank)) if pid else "exited"

        blocked = Background(blocked_reader(reads, spec.job, gen), "axond-blocked-reads")
        early = EarlyExitWatch(spec.job, self._notice, every=self._conn.env.wait_notice_s, blocked=blocked,
                               stacks=stacks, fr_dump_dir=self._conn.env.failure.fr_dump_dir)
        env = self._conn.env
        arrivals = Background(arrivals_reader(reads, spec.job, gen), "axond-arrival-reads")
        slow = StragglerWatch(spec.job, self._notice, arrivals, world_size, local,
                              env.stragglers, env.observe.metrics_dir)

        def stacks_of(rank: int) -> tuple[int, str]:
            pid = dict(zip(local, ranks.local_pids())).get(rank, 0)
            return pid, rank_stacks(pid, self._error_file(gen, rank)) if pid else "exited"

        answers = StackAnswers(reads, spec.job, gen, local, stacks_of,  # axond status --job J --stacks
                               lambda rank: self._error_file(gen, rank))
        readers.extend((blocked.close, arrivals.close, answers.close))
        nudges = live.Nudges(self._membership_paths(len(local))) if spec.live_recovery else None
        frozen = FrozenWatch(ranks, self._hb.lease, active=spec.live_recovery)  # a SIGSTOPped rank: failed
        while True:
            result = ranks.poll()
            if result is not None and result.ok:
                ranks.join_readers(timeout=2.0)
                self._flush()
                self._reports.report_exit(gen, 0)
                # Like torchrun's exit barrier: stay until the whole job ended, so that a node whose ranks are
                # done neither misses a restart nor exits (ending `docker compose up`) while others still work.
                return self._reports.exit_barrier(gen) if spec.max_restarts > 0 or nnodes > 1 else JobOutcome(0)
            if result is not None and result.first_failure is not None:
                tell_accused(spec.job, ranks, local, stacks, self._notice)  # now: before the root-cause wait
                failure = frozen.explain(ranks.root_cause(min(CAUSE_GRACE_S, max(spec.stop_grace, 0.5)))
                                         or result.first_failure)
                self._notice(f"{describe_failure(failure, ranks.exits())}; stopping the other local ranks")
                ranks.stop(grace=spec.stop_grace)
                # every local rank exited now: one may have failed earlier still, or be the one the others blame
                failure = frozen.explain(ranks.root_cause(0.0) or failure)
                message = describe_failure(failure, ranks.exits())
                self._flush()
                if nnodes > 1 and caused_elsewhere(failure, local):
                    told = self._reports.told_of_other_failure(gen)
                    if told is not None:
                        return told.outcome
                try:
                    reply = self._reports.within_lease(lambda: self._client.report_failure(
                        spec.job, self._node_id, gen, failure.rank, failure.exit_code, message
                    ))
                except (CoordinatorError, ValueError) as e:
                    # untold, the coordinator decides the job's fate when it is back: the unreachable exit, not 1
                    return JobOutcome(failure.exit_code, f"{message} (and the coordinator was not told: {e})",
                                      error=e if isinstance(e, CoordinatorError) else None)
                if reply.left_job:
                    if rejoin_after_left(spec.job, message, self._restarts_left, self._notice):
                        self._rejoins = True
                        return None
                    return JobOutcome(failure.exit_code, f"{message}; job {spec.job!r} goes on without this node "
                                      "(live recovery)")
                if reply.will_restart and not self._stop.is_set():
                    self._notice(f"job {spec.job!r} restarts as generation {reply.generation}")
                    return None
                self._reports.report_exit(gen, failure.exit_code)
                return JobOutcome(failure.exit_code, message)
            if self._stop.is_set():
                return JobOutcome(self._stop_code, self._stop_reason)
            if guard.deciding():  # decided, and the ranks dead, by the time the coordinator may declare this node dead
                why = guard.stop_reason()
                if why is not None:
                    ranks.stop(grace=min(spec.stop_grace, max(0.0, guard.fence_deadline() - time.monotonic())))
                    self._notice(why)
                    if spec.live_recovery and self._restarts_left > 0 and self._back_after_lease(gen, why):
                        return None  # its ranks are dead: it re-joins the job as a replacement (one restart)
                    return JobOutcome(LEASE_LOST_EXIT_CODE, why, lease_lost=True)
            if nudges is not None and nudges.due(time.monotonic()):
                self._hb.beat_now()  # a local rank lost a peer: hear of the next generation now
            lost = links.poll() if links is not None else None
            if lost and links is not None:  # a cut link while every node keeps its lease: the coordinator decides
                ended, outcome = self._report_cut(ranks, gen, lost, links)
                if ended:
                    return outcome
            beat = self._hb.latest(spec.job)
            if self._joins is not None:
                self._joins.check(beat)
            if beat is not None and self._moves_live(beat, gen, ranks):
                if nudges is not None:
                    nudges.clear()
                return None
            if beat is not None and beat.generation > gen and links is not None and not links.reported \
                    and beat.job_state not in TERMINAL_STATES:  # left out for a cut link, before this node's report
                lost = links.settle(2 * PROBE_TIMEOUT_S + 0.5)
                ended, outcome = self._report_cut(ranks, gen, lost, links) if lost else (False, None)
                if ended:
                    return outcome
            if beat is not None and (beat.generation > gen or beat.job_state in TERMINAL_STATES):
                ranks.stop(grace=spec.stop_grace)
                reason = beat.reason or "no reason given"
                if beat.job_state in TERMINAL_STATES:
                    state = pb.JobState.Name(beat.job_state).removeprefix("JOB_STATE_").lower()
                    why = reason if beat.job_state == pb.JOB_STATE_FAILED else f"the job was {state}: {reason}"
                    return JobOutcome(JOB_FAILED_ELSEWHERE_EXIT_CODE, why)
                self._notice(f"job {spec.job!r} moved to generation {beat.generation} ({reason}); re-joining")
                return None
            for line in frozen.check():
                self._notice(f"job {spec.job!r}: {line}")
            early.check(ranks.exits(), local)
            if not ranks.exits():
                slow.check()
            answers.check()
            self._hb.changed.wait(MONITOR_TICK_S)
            self._hb.changed.clear()

    def _back_after_lease(self, gen: int, why: str) -> bool:
        """A live job's node that lost its lease (its ranks stopped): once the coordinator answers again, report the
        failure and say whether to re-join (the job went on without this node and restarts are left, or it restarts
        everyone)."""
        spec = self._spec
        reply = report_when_back(lambda: self._client.report_failure(
            spec.job, self._node_id, gen, -1, LEASE_LOST_EXIT_CODE, why), spec.join_timeout, self._stop.is_set)
        if reply is None:
            return False
        if reply.left_job:
            self._rejoins = rejoin_after_left(spec.job, why, self._restarts_left, self._notice)
            return self._rejoins
        if reply.will_restart:
            self._notice(f"job {spec.job!r} restarts as generation {reply.generation}")
        return reply.will_restart

    def _moves_live(self, beat: pb.HeartbeatResponse, gen: int, ranks: LocalRanks) -> bool:
        """Live recovery: the job moved on without a failed node and every local rank still runs: tell them (their
        collectives raise `MembershipChanged`), keep them, and re-join."""
        if not (self._spec.live_recovery and beat.live and beat.generation > gen) or ranks.exits():
            return False
        if beat.job_state in TERMINAL_STATES or any(pid == 0 for pid in ranks.local_pids()):
            return False
        self._live_reason = beat.reason or "a node left"
        live.announce(self._membership_paths(len(ranks.ranks)), beat.generation, self._live_reason)
        self._notice(f"job {self._spec.job!r} re-forms live as generation {beat.generation} ({self._live_reason}); "
                     "re-joining with the ranks running")
        self._kept = ranks
        return True

    def _report_cut(self, ranks: LocalRanks, gen: int, lost: list[int],
                    links: LinkCheck) -> tuple[bool, JobOutcome | None]:
        """A cut link (`Reports.report_cut`); (True, None): the job went on without this node, which re-joins."""
        ended, outcome = self._reports.report_cut(ranks, gen, lost, links, self._restarts_left, self._flush)
        if ended and outcome is None:
            self._rejoins = True
        return ended, outcome
