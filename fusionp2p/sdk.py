"""The Python SDK: publish a training job to a swarm and follow it, synchronously.

::

    import fusionp2p as fp      # or: from fusionp2p.sdk import Swarm
    with Swarm.local(n_nodes=4) as swarm:                      # embedded swarm, in a background thread
        job = swarm.publish(model=my_module, loss=None, dataset=BuiltinCorpus(seq_len=64),
                            config=TrainConfig(steps=50, micro_batch=8, micro_batches=4, replicas=2))
        for event in job.events():        # StepProgress, PlanChanged, CheckpointSaved, JobStateChanged
            ...
        job.wait(timeout=600)             # JobError if the job failed or was cancelled
        job.download("out/")              # out/model.safetensors, keys of my_module.state_dict()

Theory of operation. ``Swarm.local`` starts one ``trio.run`` in a daemon thread holding an in-memory
network (``fusionp2p.net.memory``): a publisher host and ``n_nodes`` node hosts, each with its own
content store and content service. ``publish`` traces the model in the caller's thread (so that
tracing errors raise right there, as ``ConfigError``), then hands the signed envelope and the blobs to
the trio thread. There every node verifies the signature, fetches the DAG, the weights and the data by
hash from the publisher, checks that it fits, and computes the plan; the plan is adopted when every
accepting node computed the same hash. Then all stage replicas run (``train/worker.py``) and
progress events flow to the job's queue. A job that no node accepts fails with the nodes' reasons.

``Swarm.connect(bootstrap=[...])`` runs the same user API against real node processes: a libp2p
client in the background thread hosts a :class:`~fusionp2p.jobs.publisher.Publisher` (content
served by hash, JOB reports in, progress from the jobs gossip topic); the nodes run
``jobs/node.py`` (see docs/sdk.md for the whole flow).
"""

from __future__ import annotations

import logging
import os
import queue
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
import trio
from torch import nn

from fusionp2p.errors import FusionError, JobError, PeerUnavailable
from fusionp2p.jobs.build import (
    AcceptedJob,
    BuiltJob,
    Dataset,
    LossFn,
    NodeJobs,
    build_job,
    choose_plan,
    module_state,
    run_local_job,
    save_module_state,
)
from fusionp2p.jobs.checkpoint import assemble, latest_complete_step
from fusionp2p.jobs.content import ContentService, ContentStore
from fusionp2p.jobs.events import (
    JobStateChanged,
    MetricsWriter,
    ProgressEvent,
    StepProgress,
)
from fusionp2p.jobs.lifecycle import JobState
from fusionp2p.jobs.publisher import Publisher, discover
from fusionp2p.jobs.spec import Resources
from fusionp2p.net.identity import Identity
from fusionp2p.net.memory import MemoryTransport, memory_network
from fusionp2p.net.transport import Transport
from fusionp2p.train.config import TrainConfig
from fusionp2p.types import DeviceProfile

log = logging.getLogger(__name__)

LOCAL_PROFILE = DeviceProfile(device="cpu", kind="cpu", name="local-cpu", flops_fp32=2e10, flops_bf16=0.0,
                              memory_bytes=4 * 2**30)
_TERMINAL = {s.value for s in JobState if s.terminal}


class Job:
    """A published job, seen from the publisher: events, wait, download, cancel."""

    def __init__(self, swarm: Swarm, built: BuiltJob, home: Path) -> None:
        self._swarm = swarm
        self.spec = built.spec
        self.dag = built.dag
        self.id = built.spec.job_id
        self.home = home
        self._events: queue.Queue[ProgressEvent] = queue.Queue()
        self._done = threading.Event()
        self._cancel: trio.CancelScope | None = None
        self.state = JobState.PENDING
        self.error: str = ""
        self.losses: dict[int, float] = {}       # step -> mean loss over the pipelines
        self.final_loss: float | None = None     # evaluation of the final weights on the batch after the last
        self.history: list[ProgressEvent] = []
        self._metrics = MetricsWriter(home / "metrics.jsonl")

    # -------------------------------------------------- called in the trio thread
    def _emit(self, ev: ProgressEvent) -> None:
        if isinstance(ev, StepProgress) and ev.loss is not None:
            if ev.step >= self.spec.config.steps:
                self.final_loss = ev.loss
            else:
                self.losses[ev.step] = ev.loss
        if isinstance(ev, JobStateChanged):
            self.state = JobState(ev.state)
            if self.state in (JobState.FAILED, JobState.CANCELLED):
                self.error = ev.reason
        self.history.append(ev)
        self._metrics.write(ev)
        self._events.put(ev)
        if isinstance(ev, JobStateChanged) and ev.state in _TERMINAL:
            self._metrics.close()
            self._done.set()

    # -------------------------------------------------- user API
    def events(self, timeout: float | None = None) -> Iterator[ProgressEvent]:
        """Every progress event in order, ending after the terminal JobStateChanged."""
        while True:
            try:
                ev = self._events.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"job {self.id}: no event within {timeout}s") from None
            yield ev
            if isinstance(ev, JobStateChanged) and ev.state in _TERMINAL:
                return

    def wait(self, timeout: float | None = None) -> Job:
        """Block until the job ends; JobError if it failed or was cancelled, TimeoutError on *timeout*."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"job {self.id} still {self.state.value} after {timeout}s")
        if self.state is not JobState.DONE:
            raise JobError(f"job {self.id} {self.state.value}: {self.error}")
        return self

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The trained weights under the user's module's ``state_dict`` names (latest complete checkpoint)."""
        root = self.home / "checkpoints"
        step = latest_complete_step(root, self.id)
        if step is None:
            raise JobError(f"job {self.id}: no complete checkpoint yet")
        return module_state(self.dag, assemble(root, self.id, step))

    def download(self, directory: str | os.PathLike[str]) -> Path:
        """Write ``model.safetensors`` (load with ``safetensors.torch.load_file`` + ``load_state_dict``)."""
        return save_module_state(Path(directory) / "model.safetensors", self.state_dict())

    def load_into(self, module: nn.Module) -> nn.Module:
        """Copy the trained weights into *module* (the module that was published, or one like it)."""
        module.load_state_dict(self.state_dict(), strict=False)
        return module

    def cancel(self) -> None:
        """Stop the job (CANCELLED); returns once the request is delivered."""
        scope = self._cancel
        if scope is not None:
            self._swarm._call_soon(scope.cancel)


class Swarm:
    """A handle on a swarm; use :meth:`local` (embedded, in-process)."""

    def __init__(self, n_nodes: int, profiles: list[DeviceProfile] | None, home: Path, *,
                 bootstrap: list[str] | None = None, identity: Identity | None = None,
                 listen: str = "/ip4/0.0.0.0/tcp/0") -> None:
        self.n_nodes = n_nodes
        self.profiles = profiles or [LOCAL_PROFILE] * n_nodes
        if len(self.profiles) != n_nodes:
            raise ValueError("give one DeviceProfile per node")
        self.home = home
        self._identity = identity or Identity.generate()
        self._bootstrap = list(bootstrap or [])
        self._listen = listen
        self._token: trio.lowlevel.TrioToken | None = None
        self._nursery: trio.Nursery | None = None
        self._stop: trio.Event | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._pub: ContentService | None = None
        self._pub_host: MemoryTransport | None = None
        self._nodes: list[tuple[str, NodeJobs]] = []
        self._transport: Transport | None = None                  # connect mode: the client's libp2p transport
        self._boot_peers: list[str] = []
        self._publisher: Publisher | None = None
        self._thread = threading.Thread(target=self._main, name="fusionp2p-swarm", daemon=True)

    @property
    def remote(self) -> bool:
        """True for a swarm reached with :meth:`connect` (real processes over libp2p)."""
        return bool(self._bootstrap)

    @classmethod
    def connect(cls, bootstrap: list[str], *, identity: Identity | None = None,
                home: str | os.PathLike[str] | None = None, listen: str = "/ip4/0.0.0.0/tcp/0") -> Swarm:
        """Join a running swarm as a client (no training) through *bootstrap* multiaddrs.

        Starts a libp2p transport (an ephemeral identity unless one is given) in a background
        thread. Jobs published here are offered to the swarm's nodes, their content is served
        from this process, progress arrives on gossip and the trained model is downloaded by hash.
        PeerUnavailable if no bootstrap answers.
        """
        if not bootstrap:
            raise ValueError("Swarm.connect needs at least one bootstrap multiaddr")
        from fusionp2p.net.libp2p_host import parse_peer_addr

        for b in bootstrap:
            parse_peer_addr(b)   # ConfigError on a malformed address, before any thread starts
        root = Path(home) if home is not None else Path(tempfile.mkdtemp(prefix="fusionp2p-client-"))
        swarm = cls(0, [], root, bootstrap=list(bootstrap), identity=identity, listen=listen)
        swarm._thread.start()
        swarm._ready.wait()
        if swarm._error is not None:
            raise swarm._error
        return swarm

    @classmethod
    def local(cls, n_nodes: int = 4, *, profiles: list[DeviceProfile] | None = None,
              home: str | os.PathLike[str] | None = None) -> Swarm:
        """Start an embedded swarm of *n_nodes* nodes in a background thread."""
        if n_nodes < 1:
            raise ValueError("a swarm needs at least one node")
        root = Path(home) if home is not None else Path(tempfile.mkdtemp(prefix="fusionp2p-"))
        swarm = cls(n_nodes, profiles, root)
        swarm._thread.start()
        swarm._ready.wait()
        if swarm._error is not None:
            raise swarm._error
        return swarm

    # -------------------------------------------------- trio thread
    def _main(self) -> None:
        try:
            trio.run(self._serve_remote if self.remote else self._serve)
        except BaseException as exc:  # surfaced to the caller of local()/connect()/close()
            # trio wraps errors raised inside nurseries in groups; the caller wants the error itself
            self._error = _root_error(exc)
            self._ready.set()

    async def _serve(self) -> None:
        async with memory_network() as net, trio.open_nursery() as nursery:
            self._pub_host = net.add_host(self._identity)
            self._pub = ContentService(self._pub_host, ContentStore())
            self._pub.install()
            for prof in self.profiles:
                host = net.add_host()
                svc = ContentService(host, ContentStore())
                svc.install()
                self._nodes.append((host.peer_id, NodeJobs(svc, prof)))
            self._token = trio.lowlevel.current_trio_token()
            self._nursery = nursery
            self._stop = trio.Event()
            self._ready.set()
            await self._stop.wait()
            nursery.cancel_scope.cancel()

    async def _serve_remote(self) -> None:
        from fusionp2p.net.libp2p_host import Libp2pConfig, open_libp2p_transport

        async with open_libp2p_transport(self._identity, Libp2pConfig(listen=(self._listen,))) as t, \
                trio.open_nursery() as nursery:
            self._transport = t
            self._pub = ContentService(t, ContentStore())
            errors: list[str] = []
            for addr in self._bootstrap:
                try:
                    self._boot_peers.append(await t.connect(addr))
                except PeerUnavailable as exc:
                    errors.append(str(exc))
            if not self._boot_peers:
                raise PeerUnavailable(self._bootstrap[0].rsplit("/p2p/", 1)[-1], "; ".join(errors))
            self._publisher = Publisher(t, self._pub, self._boot_peers)
            await nursery.start(self._publisher.run)
            self._token = trio.lowlevel.current_trio_token()
            self._nursery = nursery
            self._stop = trio.Event()
            self._ready.set()
            await self._stop.wait()
            nursery.cancel_scope.cancel()

    async def _run_remote_job(self, job: Job, built: BuiltJob) -> None:
        assert self._publisher is not None
        try:
            with trio.CancelScope() as scope:
                job._cancel = scope
                await self._publisher.run_job(built, job._emit, job.home / "checkpoints")
            if scope.cancelled_caught:
                job._emit(JobStateChanged(job=job.id, state=JobState.CANCELLED.value, reason="cancelled by the publisher",
                                          at=time.time()))
        except Exception as exc:   # never leave the user's wait() hanging
            log.exception("job %s failed", job.id)
            job._emit(JobStateChanged(job=job.id, state=JobState.FAILED.value, reason=f"{type(exc).__name__}: {exc}",
                                      at=time.time()))

    def members(self, timeout: float = 15.0) -> list[str]:
        """Peer ids of the live training nodes (connect mode: the bootstrap's verified view)."""
        if not self.remote:
            return [p for p, _ in self._nodes]
        if self._token is None:
            raise JobError("the swarm is closed")
        t = self._transport
        assert t is not None

        async def ask() -> list[str]:
            return sorted((await discover(t, self._boot_peers, timeout=timeout)).members)

        return trio.from_thread.run(ask, trio_token=self._token)

    def _call_soon(self, fn: Callable[[], Any]) -> None:
        assert self._token is not None
        trio.from_thread.run_sync(fn, trio_token=self._token)

    async def _run_job(self, job: Job, built: BuiltJob) -> None:
        assert self._pub is not None
        assert self._pub_host is not None
        now = time.time

        def state(s: JobState, reason: str = "") -> None:
            job._emit(JobStateChanged(job=job.id, state=s.value, reason=reason, at=now()))

        with trio.CancelScope() as scope:
            job._cancel = scope
            try:
                for blob in built.blobs.values():
                    await self._pub.publish(blob)
                accepted: dict[str, AcceptedJob] = {}
                refused: dict[str, str] = {}
                for peer, node in self._nodes:
                    try:
                        with trio.fail_after(120):
                            accepted[peer] = await node.accept(built.envelope, peers=[self._pub_host.peer_id])
                    except (FusionError, ValueError, trio.TooSlowError) as exc:
                        refused[peer] = f"{type(exc).__name__}: {exc}"
                        log.warning("node %s refused job %s: %s", peer[:12], job.id, exc)
                if not accepted:
                    why = "; ".join(sorted(set(refused.values())))
                    state(JobState.FAILED, f"no node accepted the job ({why})")
                    return
                members = {p: prof for (p, _), prof in zip(self._nodes, self.profiles, strict=True) if p in accepted}
                # every node plans on its own; the plan is adopted when all hashes agree
                plans = {p: choose_plan(a.spec, a.dag, members) for p, a in accepted.items()}
                hashes = {pl.plan_hash() for pl in plans.values()}
                if len(hashes) != 1:
                    state(JobState.FAILED, f"nodes computed {len(hashes)} different plans")
                    return
                plan = next(iter(plans.values()))
                state(JobState.PLANNED, plan.plan_hash())
                state(JobState.RUNNING)

                async def emit(ev: ProgressEvent) -> None:
                    job._emit(ev)

                await run_local_job({p: accepted[p] for p in plan.peers}, plan, ckpt_root=job.home / "checkpoints",
                                    emit=emit)
                state(JobState.DONE)
            except FusionError as exc:
                log.exception("job %s failed", job.id)
                state(JobState.FAILED, f"{type(exc).__name__}: {exc}")
            except Exception as exc:
                log.exception("job %s failed", job.id)
                state(JobState.FAILED, f"{type(exc).__name__}: {exc}")
        if scope.cancelled_caught:
            state(JobState.CANCELLED, "cancelled by the publisher")

    # -------------------------------------------------- user API
    def publish(self, *, model: nn.Module, dataset: Dataset, config: TrainConfig, loss: LossFn | None = None,
                resources: Resources | None = None, name: str = "") -> Job:
        """Trace *model* (with *loss*, or returning ``(output, loss)``), sign and announce the job.

        Raises ConfigError right away when the model cannot be traced; everything later (no node
        fits, a refused spec, a failed node) ends the job FAILED with the reason.
        """
        if self._token is None or self._nursery is None:
            raise JobError("the swarm is closed")
        built = build_job(model, loss, dataset, config, publisher=self._identity.peer_id, sign=self._identity.sign,
                          now=time.time(), nonce=os.urandom(16), resources=resources, name=name)
        return self.publish_built(built)

    def publish_built(self, built: BuiltJob) -> Job:
        """Announce an already built (and signed) job; for tools and tests."""
        home = self.home / built.spec.job_id
        home.mkdir(parents=True, exist_ok=True)
        job = Job(self, built, home)
        nursery = self._nursery
        assert nursery is not None
        run = self._run_remote_job if self.remote else self._run_job
        self._call_soon(lambda: nursery.start_soon(run, job, built))
        return job

    @property
    def publisher_id(self) -> str:
        return self._identity.peer_id

    def sign(self, data: bytes) -> bytes:
        return self._identity.sign(data)

    def close(self) -> None:
        """Stop every job and the swarm (idempotent)."""
        if self._stop is not None and self._thread.is_alive():
            stop = self._stop
            self._call_soon(stop.set)
        self._thread.join(timeout=30)

    def __enter__(self) -> Swarm:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


__all__ = ["Job", "Swarm"]


def _root_error(exc: BaseException) -> BaseException:
    """The error a caller wants from a trio exception group: our own (FusionError) first, else the first leaf.

    Under load, libp2p teardown errors can join ours in the group, so a one-member unwrap is not enough.
    """
    from fusionp2p.errors import FusionError, leaf_errors

    leaves = leaf_errors(exc)
    ours = [e for e in leaves if isinstance(e, FusionError)]
    return ours[0] if ours else leaves[0]
