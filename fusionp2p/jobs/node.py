"""A node's job service: the JOB protocol, the data plane, and one :class:`~fusionp2p.jobs.run.JobRun` per job.

Theory of operation. :class:`NodeJobService` runs inside ``fusionp2p node`` (started by the daemon
hook in ``cli/main.py``) and inside every node of an embedded swarm (``jobs/embedded.py``). It serves
the JOB control protocol (``jobs/proto.py``):

* ``offer``: the signed envelope is verified (the offering peer must be the spec's publisher, or a
  member of the job's adopted plan taking in a joiner), the node checks that it fits and fetches the
  DAG, weights and data shards by hash (``ContentService``: every blob checked against its hash).
  ``ok`` means "accepted", with the device profile the node checked the fit against (``profile``: a
  publisher that found no profile in the node's record, its start-up not run yet, plans with this one).
  An offer that no ``start`` follows within ``offer_ttl`` is forgotten.
* ``start``: a snapshot of the members for an epoch, with the resume (where each stage's state comes
  from). Epoch 0 comes from the publisher; later epochs from a member of the job (its leader). The
  job's :class:`JobRun` elects the plan and trains (``jobs/run.py``).
* ``halt`` / ``status`` / ``keep`` / ``done``: the re-plan and checkpoint traffic between members.
* ``cancel``: from the publisher.
* ``measure``: from the publisher, before it adopts the first plan: probe our link to another member now and
  answer the figure (``jobs/verify_links.py``: at most 16 per job, one at a time).
* ``receipt`` / ``receipts``: a finished job's publisher hands this node its signed work receipt, which it
  shows to whoever asks (a publisher or leader that requires a standing: ``jobs/reputation.py``).

Data-plane channels are encrypted TCP (``net/bulk.py``) wrapped in reconnecting channels
(``net/resilient.py``) named ``"<job>/e<epoch>/<link>"``. The lower stage (or replica index) dials;
:class:`~fusionp2p.net.resilient.ResilientAcceptor` takes every incoming channel and the job claims
it by (authenticated peer, name); a channel from anyone who is not a member of the job is dropped.

Every wait has a deadline (config below). A job's failure is reported and never takes the node down.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import dataclasses
import gc
import logging
from collections import Counter
from pathlib import Path
from typing import Any

import trio

from fusionp2p.errors import FusionError, PeerUnavailable, RemoteProtocolError
from fusionp2p.jobs import proto as job_proto
from fusionp2p.jobs.build import NodeJobs
from fusionp2p.jobs.content import ContentService, ContentStore
from fusionp2p.jobs.election import fetch_latest
from fusionp2p.jobs.events import ProgressEvent, decode_event
from fusionp2p.jobs.host import NodeJobConfig
from fusionp2p.jobs.lifecycle import JobState
from fusionp2p.jobs.liveness import DeathProbes
from fusionp2p.jobs.records import register_rankers
from fusionp2p.jobs.replan import Resume
from fusionp2p.jobs.reputation import ReceiptBook, decode_receipt
from fusionp2p.jobs.run import JobRun, StartRequest, describe
from fusionp2p.jobs.status import JobView
from fusionp2p.jobs.verify_links import MeasureDesk
from fusionp2p.net.addrs import tcp_endpoint, tcp_multiaddr
from fusionp2p.net.bulk import DataPlane, DataPlaneConfig, open_data_plane
from fusionp2p.net.resilient import (
    ResilientAcceptor,
    ResilientChannel,
    open_resilient_acceptor,
)
from fusionp2p.plan import Plan
from fusionp2p.plan.snapshot import Snapshot
from fusionp2p.swarm.membership import Change, MemberEvent
from fusionp2p.swarm.node import SwarmNode
from fusionp2p.types import short_peer
from fusionp2p.wire.protocols import JOB, TOPIC_JOBS

log = logging.getLogger(__name__)


MAX_OFFERERS = 64   # members remembered as having offered one pending job to this node


class NodeJobService:
    """Serves JOB requests and runs accepted jobs on one node (see the module docstring)."""

    def __init__(self, swarm: SwarmNode, home: Path, config: NodeJobConfig | None = None) -> None:
        self.swarm = swarm
        self.transport = swarm.transport
        self.home = home
        self.config = config or NodeJobConfig()
        # refused input of JOB, content and the data plane is counted in the swarm's table (SwarmNode.refusals)
        self.refusals = getattr(swarm, "refusals", None)
        self.content = ContentService(self.transport, ContentStore(home / "content", self.config.store),
                                      refusals=self.refusals)
        self.jobs: dict[str, JobRun] = {}
        self._receipts: ReceiptBook | None = None   # this node's work receipts (jobs/reputation.py), made on first use
        # peers of lost links asked directly; a refusal breaks the pipelines of their jobs (jobs/liveness.py)
        self.deaths = DeathProbes(self.transport, self.config.probes, on_dead=self._on_dead)
        self._offers: dict[str, float] = {}          # job -> when accepted (until its first start)
        # channels that arrived and wait for their job to claim them, by (job, link name, peer)
        self._arrived: dict[tuple[str, str, str], ResilientChannel] = {}
        self._arrival = trio.Event()
        self._dp: DataPlane | None = None
        self._nursery: trio.Nursery | None = None
        self._subs: dict[str, trio.MemorySendChannel[tuple[str, ProgressEvent]]] = {}
        self._intakes: Counter[str] = Counter()   # offers being verified and fetched now, by offering peer (hold a slot)
        self._intake_ids = 0                       # names the pins of an offer being fetched (its job id is not known yet)
        self._measure: MeasureDesk | None = None   # links measured for a publisher before its plan (jobs/verify_links.py)
        self.planning = trio.CapacityLimiter(1)   # the node's plans, one at a time, in a thread (jobs/plan_thread.py)

    @property
    def receipts(self) -> ReceiptBook:
        """This node's work receipts (made on first use: a service may be built before its transport is up)."""
        if self._receipts is None:
            self._receipts = ReceiptBook(self.transport.peer_id)
        return self._receipts

    def status(self) -> list[JobView]:
        """The jobs this node holds, as plain data (read by the dashboard and the metrics, ``fusionp2p/ops``)."""
        return [JobView(job=job_id, state=run.state.value, publisher=run.publisher, steps=run.spec.config.steps,
                        reason=run.reason, role=run.role, plan=run.plan, last=run.last)
                for job_id, run in self.jobs.items()]

    @property
    def nursery(self) -> trio.Nursery:
        assert self._nursery is not None, "the service is not running"
        return self._nursery

    def training(self) -> bool:
        """Whether this node runs a stage of a job now (a role in a running job's plan)."""
        return any(j.role is not None and j.state is JobState.RUNNING for j in self.jobs.values())

    @property
    def data_plane(self) -> DataPlane:
        assert self._dp is not None, "the service is not running"
        return self._dp

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Install the JOB and CONTENT handlers, open the data plane, serve until cancelled."""
        dp_cfg = self._data_plane_config()
        register_rankers(self.transport)
        self.swarm.listeners.append(self._on_member_event)   # a death or departure wakes the jobs' leaders
        self.content.install()
        gossip = await self.transport.subscribe(TOPIC_JOBS)   # keeps us in the jobs topic's mesh
        # exit order: the jobs' tasks, then the acceptor (goodbye on every accepted channel), then the plane
        async with (open_data_plane(self.transport, config=dp_cfg, admit=self._admits,
                                    refusals=self.refusals) as dp,
                    open_resilient_acceptor(config=self.config.channels(), peer_gone=self.peer_gone) as acc,
                    trio.open_nursery() as nursery):
            self._dp, self._nursery = dp, nursery
            self.swarm.set_data_addrs(self._data_addrs(dp))   # announced from our next heartbeat on, and checked
            self.swarm.set_raw_path(dp)   # probes time both directions on raw sockets to this port
            self.swarm.set_training(self.training)   # no re-measurement of our links while we train
            await nursery.start(acc.serve, dp.incoming)
            nursery.start_soon(self._route_incoming, acc)
            nursery.start_soon(self._dispatch_gossip, gossip)
            nursery.start_soon(self._expire_offers)
            nursery.start_soon(self.deaths.serve)
            limit = max(self.config.recv_timeout, self.config.accept_timeout) + 60
            self.transport.set_stream_handler(JOB, job_proto.serve(self.handle, timeout=limit, refusals=self.refusals))
            log.info("job service ready (data plane listens on %s:%d, announced as %s)", dp.host, dp.port,
                     " ".join(self.swarm.data_addrs) or "-")
            task_status.started()
            await trio.sleep_forever()

    def _data_plane_config(self) -> DataPlaneConfig:
        cfg = self.config
        if cfg.data_listen is not None:
            host, port = tcp_endpoint(cfg.data_listen, "--data-listen")
            dp = dataclasses.replace(cfg.data_plane, listen_host=host, listen_port=port)
        else:
            dp = dataclasses.replace(cfg.data_plane, listen_host=self._bulk_host())
        if cfg.data_announce is not None:
            host, port = tcp_endpoint(cfg.data_announce, "--data-announce", announce=True)
            dp = dataclasses.replace(dp, advertise_host=host, advertise_port=port)
        return dp

    def _data_addrs(self, dp: DataPlane) -> tuple[str, ...]:
        """The data plane's multiaddrs for our node record: the announced one, else the bound port at
        every address the libp2p transport announces (a wildcard bind) or at the bound address."""
        if self.config.data_announce is not None:
            return (self.config.data_announce,)
        host, port = dp.announced
        if host not in ("0.0.0.0", "::"):
            return (tcp_multiaddr(host, port),)
        out: list[str] = []
        for a in self.transport.listen_addrs():
            parts = a.split("/")
            if len(parts) > 2 and parts[1] in ("ip4", "ip6"):
                addr = tcp_multiaddr(parts[2], port)
                if addr not in out:
                    out.append(addr)
        return tuple(out[:8])

    def _admits(self, peer: str) -> bool:
        """The data plane issues tickets only to members of a job this node has started (strangers cost
        nothing there: no key, ticket, socket or thread; net/admission.py)."""
        return any(nj.members is not None and peer in nj.members for nj in self.jobs.values())

    def _bulk_host(self) -> str:
        # Bind the data plane where the transport listens: loopback stays loopback.
        for a in self.transport.listen_addrs():
            parts = a.split("/")
            if len(parts) > 2 and parts[1] == "ip4":
                return parts[2] if parts[2] == "127.0.0.1" else "0.0.0.0"
            if len(parts) > 1 and parts[1] == "memory":
                return "127.0.0.1"     # the embedded swarm (one process)
        return "0.0.0.0"

    async def _provide(self, hashes: list[str]) -> None:
        for h in hashes:
            await self.transport.provide(h)   # bounded by the transport's DHT timeout

    def _on_member_event(self, event: Any) -> None:
        if isinstance(event, MemberEvent) and event.change in (Change.JOINED, Change.REVIVED):
            self.deaths.forget(event.peer)   # a node restarted with its identity is alive again
        for run in self.jobs.values():
            if not run.state.terminal:
                run.poke()

    def _on_dead(self, peer: str) -> None:
        for run in self.jobs.values():
            if not run.state.terminal:
                run.on_dead(peer)

    # ------------------------------------------------------------------ gossip for the jobs
    def subscribe_job(self, job: str) -> trio.MemoryReceiveChannel[tuple[str, ProgressEvent]]:
        """The progress events of *job* on the jobs topic (a bounded channel; overflow is dropped)."""
        send, recv = trio.open_memory_channel[tuple[str, ProgressEvent]](1024)
        self._subs[job] = send
        return recv

    async def _dispatch_gossip(self, ch: trio.MemoryReceiveChannel[Any]) -> None:
        async for msg in ch:
            try:
                ev = decode_event(msg.data)
            except RemoteProtocolError:
                continue   # plan votes and other traffic of the jobs topic
            send = self._subs.get(ev.job)
            if send is not None:
                with contextlib.suppress(trio.WouldBlock, trio.ClosedResourceError, trio.BrokenResourceError):
                    send.send_nowait((msg.sender, ev))   # a slow job drops progress, never blocks the topic

    # ------------------------------------------------------------------ control protocol
    async def handle(self, peer: str, req: dict[str, Any]) -> dict[str, Any]:
        op = req["op"]
        if op == "offer":
            env = req.get("envelope")
            if not isinstance(env, bytes):
                raise RemoteProtocolError("offer: envelope must be bytes")
            via = req.get("via")
            return await self._offer(peer, env, via if isinstance(via, str) else None)
        job_id = job_proto.str_field(req, "job", op, limit=64)
        if op == "receipts":   # asked before an offer: the job need not be known here
            return {"ok": True, "receipts": self.receipts.shown()}
        run = self.jobs.get(job_id)
        if op == "status":
            if run is None:
                return {"ok": False, "state": "", "reason": "unknown job"}
            return {"ok": True, "state": run.state.value, "reason": run.reason, **run.progress()}
        if run is None:
            return {"ok": False, "error": f"no job {job_id} here"}
        member = (run.members is not None and peer in run.members) or peer in run.offerers
        if op == "cancel":
            if peer != run.publisher:
                return {"ok": False, "error": "only the publisher cancels a job"}
            self._cancel(run)
            return {"ok": True}
        if op == "start":
            return self._start(peer, run, req)
        if op == "measure":    # a link of ours its publisher's first plan, or a leader's re-plan, depends on (verify_links)
            if self._measure is None:
                self._measure = MeasureDesk(self.transport.peer_id, self.swarm.prober, self.swarm.view)
            leader = peer != run.publisher and run.leads(peer)
            return await self._measure.answer(peer, job_id, run.publisher, req, leader=leader,
                                              epoch=run.epoch if leader else 0)
        if op == "receipt":    # only from the publisher of a job this node ran, about that job
            r = decode_receipt(req.get("receipt"))
            ok = peer == run.publisher == r.issuer and r.job == job_id and self.receipts.add(r)
            return {"ok": ok} if ok else {"ok": False, "error": "not a receipt of this node's work signed by the job's publisher"}
        if not member and peer != self.transport.peer_id:
            return {"ok": False, "error": f"{op} from a peer that is no member of job {job_id}"}
        if op == "halt":
            at = req.get("at")
            if at is not None and (isinstance(at, bool) or not isinstance(at, int) or at < 0):
                raise RemoteProtocolError("halt: 'at' must be a step or null")
            timeout = self.config.halt_timeout if at is None else self.config.recv_timeout
            halted = await run.halt(at, timeout=timeout)
            return {"ok": True, "halted": halted.to_wire()}
        if op == "keep":
            h = job_proto.str_field(req, "hash", "keep", limit=64)
            holder = job_proto.str_field(req, "holder", "keep", limit=256)
            units = req.get("units")
            if not (isinstance(units, list) and len(units) == 2 and all(
                    isinstance(u, int) and not isinstance(u, bool) and u >= 0 for u in units) and units[0] < units[1]):
                raise RemoteProtocolError("keep: units must be [start, end]")
            with self.content.store.pinned_to(job_id):   # a replicated checkpoint is kept while the job runs
                await run.keep(h, job_proto.int_field(req, "step", "keep"), job_proto.int_field(req, "stage", "keep"),
                               (units[0], units[1]), holder, shadow=req.get("shadow") is True, **_keep_link(req))
            if run.state.terminal:
                self.content.store.release(job_id)   # the job ended while we fetched: only cached from now on
            return {"ok": True}
        if op == "replan":
            run.on_replan(peer, job_proto.int_field(req, "epoch", "replan"))
            return {"ok": True}
        if op == "end":
            run.end("done" if req.get("state") == "done" else f"the job ended {str(req.get('state'))[:32]}")
            return {"ok": True}
        if op == "done":
            run.on_done(peer, req)
            return {"ok": True}
        if op in ("claims", "bundle", "stamps", "verdict"):
            return await run.on_spot(peer, req)
        return {"ok": False, "error": f"op {op} is not served by nodes"}

    def _start(self, peer: str, run: JobRun, req: dict[str, Any]) -> dict[str, Any]:
        snap_bytes, resume_raw = req.get("snapshot"), req.get("resume", {"step": 0, "sources": [], "ckpt": False,
                                                                            "lost": 0})
        if not isinstance(snap_bytes, bytes) or not isinstance(resume_raw, dict):
            raise RemoteProtocolError("start: snapshot must be bytes and resume a map")
        snap = Snapshot.from_wire(snap_bytes)
        if snap.job != run.job_id:
            return {"ok": False, "error": "the snapshot is for another job"}
        first = run.epoch < 0 and not run.members
        if first and peer != run.publisher and peer not in run.offerers:
            return {"ok": False, "error": "the first epoch is started by the publisher or the member that offered it"}
        if not first and peer != run.publisher and (run.members is None or peer not in run.members):
            return {"ok": False, "error": "a re-plan is started by a member of the job"}
        resume = Resume.from_wire(resume_raw)
        prev = req.get("previous")
        previous = Plan.from_wire(prev) if isinstance(prev, bytes) else None
        hint = req.get("plan", "")   # the plan hash the leader computed from the snapshot (a re-plan's fast path)
        why = run.offer_start(StartRequest(snapshot=snap, resume=resume, previous=previous, sender=peer,
                                           plan_hash=hint if isinstance(hint, str) and len(hint) <= 128 else ""))
        if why:
            return {"ok": False, "error": why}
        if first:
            self._offers.pop(run.job_id, None)
            self.nursery.start_soon(self._run, run)
        return {"ok": True}

    async def _run(self, run: JobRun) -> None:
        try:
            # every blob the job stores or reads (stage states, checkpoints, hand-offs) is pinned until it ends
            with self.content.store.pinned_to(run.job_id):
                await run.run()
        except Exception:   # JobRun.run ends every failure itself; this is the node's last line of defence
            log.exception("job %s ended with an error the job did not handle", run.job_id)
        finally:
            self._release(run)

    def _release(self, run: JobRun) -> None:
        """A job ended (or its offer was dropped): let go of everything it held here. Its blobs stay on disk
        as cache (its final stage files, for its publisher to download) until room is needed."""
        self._subs.pop(run.job_id, None)
        self._offers.pop(run.job_id, None)
        self.drop_arrived(run.job_id, older_than=1 << 62)   # channels a member opened that the job never claimed
        run.release()
        self.content.store.release(run.job_id)
        _trim_heap()

    def _cancel(self, run: JobRun) -> None:
        if run.scope is not None:
            run.reason = "cancelled by the publisher"
            run.scope.cancel()
        elif run.state is JobState.PENDING:
            self.jobs.pop(run.job_id, None)
            self._release(run)

    def _running(self, envelope: bytes) -> str | None:
        """The id of the job of *envelope* (the same signed bytes) when this node runs it already: started,
        not ended."""
        for job_id, run in self.jobs.items():
            if run.epoch >= 0 and not run.state.terminal and run.accepted.envelope == envelope:
                return job_id
        return None

    def _slots_used(self) -> int:
        """Jobs holding one of the node's ``max_jobs`` slots: offers still being fetched, offers accepted and
        not started (until ``offer_ttl``) and running jobs; ended jobs hold none."""
        self._forget_finished()
        return self._intakes.total() + sum(not j.state.terminal for j in self.jobs.values())

    def _pending_of(self, peer: str) -> int:
        """Offers from *peer* (the publisher, or a member offering to a joiner) not started yet."""
        return self._intakes[peer] + sum((j.offered_by or j.publisher) == peer and j.state is JobState.PENDING
                                         for j in self.jobs.values())

    async def _offer(self, peer: str, envelope: bytes, via: str | None) -> dict[str, Any]:
        held = self._running(envelope)
        if held is not None:
            # a standby offered the job it holds again (each re-plan's leader offers it to the live nodes
            # outside its plan): yes, without fetching and checking its content again (benchmarks.churn: three
            # such offers a kill); a job not started here yet takes the whole path (its offerers are checked)
            prof = self.swarm.profile
            return {"ok": True, "job": held} | ({"profile": prof.to_wire()} if prof is not None else {})
        if self._slots_used() >= self.config.max_jobs:
            return {"ok": False, "error": "this node is busy"}
        if self._pending_of(peer) >= self.config.max_offers_per_publisher:
            # one publisher (a hostile one that never starts what it offers) cannot take every slot
            return {"ok": False, "error": f"this publisher has {self.config.max_offers_per_publisher} offers pending here"}
        self._intakes[peer] += 1   # concurrent offers each hold a slot while their content is fetched
        self._intake_ids += 1
        owner = f"offer/{self._intake_ids}"
        try:
            with self.content.store.pinned_to(owner):   # what the offer fetches stays until the job ends
                return await self._intake(peer, envelope, via, owner)
        finally:
            self.content.store.release(owner)   # taken over by the job (_intake), or the offer was refused
            self._intakes[peer] -= 1
            if self._intakes[peer] <= 0:
                del self._intakes[peer]

    async def _intake(self, peer: str, envelope: bytes, via: str | None, owner: str) -> dict[str, Any]:
        profile = self.swarm.profile
        if profile is None:
            return {"ok": False, "error": "this node has no device profile"}
        try:
            intake = NodeJobs(self.content, profile)
            with trio.fail_after(self.config.accept_timeout):
                acc = await intake.accept(envelope, peers=[peer])
                if acc.spec.publisher != peer:
                    # a joiner is offered the job by a member: check it is one (the adopted plan's votes)
                    rec = await fetch_latest(self.transport, acc.spec.job_id) if via == acc.spec.job_id else None
                    if rec is None or peer not in rec[1].peers:
                        return {"ok": False, "error": "the spec is offered by neither its publisher nor a member"}
        except trio.TooSlowError:
            return {"ok": False, "error": f"fetching the job's content took over {self.config.accept_timeout:.0f} s"}
        except (FusionError, ValueError) as exc:
            if isinstance(exc, RemoteProtocolError) and self.refusals is not None:
                # malformed content of the job (a DAG, a weight manifest that does not match it): the offerer's
                self.refusals.refuse(peer, "job/content", now=trio.current_time(), detail=str(exc)[:200])
            return {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:2000]}
        job_id = acc.spec.job_id
        old = self.jobs.get(job_id)
        if old is None or old.state.terminal:
            self.jobs[job_id] = JobRun(self, acc, acc.spec.publisher)
            self._offers[job_id] = trio.current_time()
            if peer != acc.spec.publisher:
                self.jobs[job_id].offered_by = peer
        run = self.jobs[job_id]
        self.content.store.transfer(owner, job_id)
        if peer != acc.spec.publisher and run.epoch < 0 and len(run.offerers) < MAX_OFFERERS:
            # a joiner not started yet takes halts and its first start from any member that offered it the
            # job (checked above against the adopted plan): the member that leads may have changed since
            run.offerers.add(peer)
        self.nursery.start_soon(self._provide, intake.fetched)   # we can serve these blobs to others now
        log.info("accepted job %s from %s", job_id, short_peer(peer))
        return {"ok": True, "job": job_id, "profile": profile.to_wire()}

    async def _expire_offers(self) -> None:
        """An accepted offer that no start followed holds a job slot; free it after ``offer_ttl``."""
        while True:
            await trio.sleep(min(60.0, self.config.offer_ttl / 4))
            now = trio.current_time()
            for job_id, at in list(self._offers.items()):
                run = self.jobs.get(job_id)
                if run is None or run.state is not JobState.PENDING:
                    self._offers.pop(job_id, None)
                elif now - at > self.config.offer_ttl:
                    log.info("job %s: offered %.0f s ago and never started; forgotten", job_id, now - at)
                    self.jobs.pop(job_id, None)
                    self._release(run)

    def _forget_finished(self, keep: int = 64) -> None:
        """Bound the job table: the oldest finished jobs beyond *keep* are forgotten."""
        done = [k for k, j in self.jobs.items() if j.state.terminal]
        for k in done[: max(0, len(done) - keep)]:
            del self.jobs[k]

    # ------------------------------------------------------------------ data-plane links
    def peer_gone(self, peer: str) -> bool:
        """A lost link's peer is not waited for once the membership view declares it dead or departed
        (heartbeat timeout, seconds) instead of for the whole reconnect_timeout."""
        view = self.swarm.view
        if peer in view.dead or peer in view.left:
            return True
        self.deaths.suspect(peer)   # asked directly: a refusal starts the re-plan (the channel waits for the view)
        return False

    def suspect(self, peer: str) -> None:
        """Ask *peer* directly whether it lives (jobs/liveness.py)."""
        self.deaths.suspect(peer)

    async def probe(self, peer: str) -> None:
        """Ask *peer* now, and wait for the answer (jobs/liveness.py), unless the probes are off."""
        if self.config.probes.enabled:
            await self.deaths.ask(peer)

    def confirmed_dead(self, peer: str) -> bool:
        """A direct question to *peer* was refused within the probes' ttl."""
        return self.deaths.confirmed(peer)

    async def claim(self, job: str, name: str, peer: str, *, alive: Any) -> ResilientChannel:
        """The channel *peer* opened for (*job*, *name*); PeerUnavailable if the peer dies first."""
        key = (job, name, peer)
        while key not in self._arrived:
            if not alive(peer):
                raise PeerUnavailable(peer, f"gone before link {name} was set up")
            with trio.move_on_after(1.0):
                await self._arrival.wait()
        return self._arrived.pop(key)

    def drop_arrived(self, job: str, *, older_than: int) -> None:
        """Close parked channels of *job* from epochs before *older_than* (never claimed)."""
        for key in [k for k in self._arrived if k[0] == job and _epoch_of(k[1]) < older_than]:
            self.nursery.start_soon(self._arrived.pop(key).aclose)

    async def _route_incoming(self, acc: ResilientAcceptor) -> None:
        """Take every new channel from the acceptor; park it until its job claims it, or drop it."""
        async with trio.open_nursery() as nursery:
            async for ch in acc.incoming:
                try:
                    self._route_one(ch)
                except RemoteProtocolError as exc:
                    log.info("data-plane channel from %s dropped: %s", short_peer(ch.remote_peer), exc)
                    nursery.start_soon(ch.aclose)

    def _route_one(self, ch: ResilientChannel) -> None:
        job, _, name = ch.name.partition("/")
        run = self.jobs.get(job)
        if not name or run is None:
            raise RemoteProtocolError(f"data-plane channel {ch.name[:80]!r} is for no job of this node")
        if run.members is None or ch.remote_peer not in run.members:
            raise RemoteProtocolError(f"data-plane channel {name[:80]!r} of job {job} from a non-member")
        if _epoch_of(name) < run.epoch:
            raise RemoteProtocolError(f"data-plane channel {name[:80]!r} of a past epoch")
        key = (job, name, ch.remote_peer)
        if key in self._arrived or len(self._arrived) >= self.config.max_pending_links:
            raise RemoteProtocolError(f"duplicate or too many pending links ({name[:80]})")
        self._arrived[key] = ch
        self._arrival.set()
        self._arrival = trio.Event()


def _keep_link(req: dict[str, Any]) -> dict[str, Any]:
    """The data-plane link a ``keep`` request names for its bytes (jobs/shadow_plane.py), checked; {} if none."""
    link, size = req.get("link"), req.get("size")
    if link is None:
        return {}
    if not (isinstance(link, str) and 0 < len(link) <= 128 and isinstance(size, int) and not isinstance(size, bool)
            and 0 < size < 2**63):
        raise RemoteProtocolError("keep: 'link' must be a link name with its 'size'")
    return {"link": link, "size": size}


def _trim_heap() -> None:
    """Give the memory an ended job freed back to the system. The data plane keeps freed heap for the next
    message (``net/bulk_channel.py``: glibc trims only past 1 GiB), so without this a node's resident size
    after a job is its peak during the job, whatever it holds; and tensors in reference cycles (a failed
    epoch's traceback) wait for the next full collection. Once per job, on the event loop: the collection
    took 0.13 s over 256k objects here (load 10), the trim 2 ms; well inside a heartbeat. glibc only;
    elsewhere the collection alone."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)


def _epoch_of(name: str) -> int:
    """The epoch of a link name ``e<epoch>/...`` a peer chose; -1 if there is none. ASCII digits only,
    at most 18: ``"²".isdigit()`` is true and ``int("²")`` raises ValueError, which would have ended
    the channel router (it drops a channel on RemoteProtocolError only)."""
    head = name.split("/", 1)[0]
    digits = head[1:]
    if head.startswith("e") and digits.isascii() and digits.isdigit() and len(digits) <= 18:
        return int(digits)
    return -1


__all__ = ["NodeJobConfig", "NodeJobService", "describe"]
