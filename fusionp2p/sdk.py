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

Theory of operation. A :class:`Swarm` runs one ``trio.run`` in a daemon thread. It holds a
transport, a content store that serves the job's blobs by hash, and a
:class:`~fusionp2p.jobs.publisher.Publisher` (offers the job, proposes the first snapshot, follows
progress, collects the trained model). ``Swarm.connect(bootstrap=[...])`` makes that transport a libp2p
client of a running swarm of ``fusionp2p node`` processes. ``Swarm.local`` first starts an embedded
swarm in the same ``trio.run`` (``jobs/embedded.py``: a bootstrap and ``n_nodes`` nodes, each running
the real node job service over the in-memory transport, with the encrypted data plane on 127.0.0.1)
and connects to it the same way: one job path, embedded or real (docs/sdk.md).

``publish`` traces the model in the caller's thread (so that tracing errors raise right there, as
``ConfigError``), then hands the signed envelope and the blobs to the trio thread.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping
from contextlib import AsyncExitStack
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
import trio
from torch import nn

from fusionp2p.data.hf import HFTokens
from fusionp2p.errors import ConfigError, FusionError, JobError, PeerUnavailable
from fusionp2p.graph.trace import preload as preload_tracer
from fusionp2p.jobs.build import BuiltJob, Dataset, LossFn, build_job, module_state
from fusionp2p.jobs.checkpoint import assemble, latest_complete_step
from fusionp2p.jobs.content import ContentService, ContentStore
from fusionp2p.jobs.download import SINGLE_FILE_BYTES, write_download
from fusionp2p.jobs.embedded import EmbeddedConfig, EmbeddedSwarm, LinkRate, open_embedded_swarm, sites
from fusionp2p.jobs.events import EvalProgress, JobStateChanged, MetricsWriter, ProgressEvent, StepProgress
from fusionp2p.jobs.lifecycle import JobState
from fusionp2p.jobs.publisher import JobDriver, Publisher, discover, read_index, read_spec
from fusionp2p.jobs.spec import Resources
from fusionp2p.net.identity import Identity
from fusionp2p.net.transport import Transport
from fusionp2p.swarm.reach import install_reversal
from fusionp2p.train.config import TrainConfig
from fusionp2p.types import DeviceProfile
from fusionp2p.wire.dag import decode_dag
from fusionp2p.wire.jobrecords import JobStatus

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
        self.final_loss: float | None = None     # the final weights' held-out loss (docs/models.md)
        self.eval_losses: dict[int, float] = {}  # step -> held-out loss (TrainConfig.eval_every, and the end)
        self.history: list[ProgressEvent] = []
        self._metrics = MetricsWriter(home / "metrics.jsonl")

    # -------------------------------------------------- called in the trio thread
    def _emit(self, ev: ProgressEvent) -> None:
        if isinstance(ev, StepProgress) and ev.loss is not None and ev.step < self.spec.config.steps:
            self.losses[ev.step] = ev.loss
        if isinstance(ev, EvalProgress):
            self.eval_losses[ev.step] = ev.loss
            if ev.step >= self.spec.config.steps and not ev.peer:   # the publisher's mean over the pipelines
                self.final_loss = ev.loss
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

    def download(self, directory: str | os.PathLike[str], *, single_file_bytes: int = SINGLE_FILE_BYTES) -> Path:
        """Write the trained model under *directory*: ``model.safetensors`` up to *single_file_bytes*, else one
        shard per stage and ``model.safetensors.index.json`` (the Hugging Face layout), written stage by
        stage. Returns the path to load (``fusionp2p.jobs.download.load_download``, or
        ``safetensors.torch.load_file`` for the single file)."""
        return write_download(directory, self.home / "checkpoints", self.id, self.dag,
                              single_file_bytes=single_file_bytes)

    def load_into(self, module: nn.Module) -> nn.Module:
        """Copy the trained weights into *module* (the module that was published, or one like it);
        strict: every key of ``module.state_dict()`` and no other (RuntimeError otherwise)."""
        module.load_state_dict(self.state_dict(), strict=True)
        return module

    def cancel(self) -> None:
        """Stop the job (CANCELLED); returns once the request is delivered."""
        scope = self._cancel
        if scope is not None:
            self._swarm._call_soon(scope.cancel)


class Swarm:
    """A handle on a swarm: :meth:`local` (embedded, in this process) or :meth:`connect` (real nodes)."""

    def __init__(self, home: Path, *, bootstrap: list[str] | None = None, identity: Identity | None = None,
                 listen: str = "/ip4/0.0.0.0/tcp/0", local: list[DeviceProfile] | None = None,
                 embedded: EmbeddedConfig | None = None) -> None:
        self.home = home
        self._identity = identity or Identity.generate()
        self._bootstrap = list(bootstrap or [])
        self._listen = listen
        self._local = local                               # profiles of the embedded nodes, None to connect
        self._embedded_cfg = embedded
        self.embedded: EmbeddedSwarm | None = None        # Swarm.local: the nodes (for tests and tools)
        self._token: trio.lowlevel.TrioToken | None = None
        self._nursery: trio.Nursery | None = None
        self._stop: trio.Event | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._transport: Transport | None = None
        self._boot_peers: list[str] = []
        self._publisher: Publisher | None = None
        self._thread = threading.Thread(target=self._main, name="fusionp2p-swarm", daemon=True)

    @property
    def remote(self) -> bool:
        """True for a swarm reached with :meth:`connect` (real processes over libp2p)."""
        return self._local is None

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
        return cls(root, bootstrap=list(bootstrap), identity=identity, listen=listen)._start()

    @classmethod
    def local(cls, n_nodes: int = 4, *, profiles: list[DeviceProfile] | None = None,
              home: str | os.PathLike[str] | None = None, config: EmbeddedConfig | None = None,
              links: Mapping[tuple[int, int], LinkRate] | None = None) -> Swarm:
        """Start an embedded swarm of *n_nodes* nodes (real node services, in-memory transport) in a
        background thread, and connect to it.

        *links* emulates link rates between nodes on this machine, ``{(i, j): rate}`` by node index in
        bytes/s or as ``"20mbit"`` (``sites([2, 2], between="20mbit")`` builds two sites): the nodes
        measure them with their probes, the planner plans with them, and the data plane moves at them."""
        if n_nodes < 1:
            raise ValueError("a swarm needs at least one node")
        if links:
            if any(i >= n_nodes or j >= n_nodes for i, j in links):
                raise ValueError(f"links name a node index outside 0..{n_nodes - 1}")
            config = dataclasses.replace(config or EmbeddedConfig(), links=dict(links))
        profiles = profiles or [LOCAL_PROFILE] * n_nodes
        if len(profiles) != n_nodes:
            raise ValueError("give one DeviceProfile per node")
        root = Path(home) if home is not None else Path(tempfile.mkdtemp(prefix="fusionp2p-"))
        # the tracer's imports now, before the nodes' thread runs: in publish they waited on it (graph/trace.py)
        preload_tracer()
        return cls(root, local=list(profiles), embedded=config)._start()

    def _start(self) -> Swarm:
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise self._error
        return self

    # -------------------------------------------------- trio thread
    def _main(self) -> None:
        try:
            trio.run(self._serve)
        except BaseException as exc:  # surfaced to the caller of local()/connect()/close()
            # trio wraps errors raised inside nurseries in groups; the caller wants the error itself
            self._error = _root_error(exc)
            self._ready.set()

    async def _serve(self) -> None:
        async with AsyncExitStack() as stack:
            transport: Transport
            if self._local is not None:
                emb = await stack.enter_async_context(
                    open_embedded_swarm(self._local, self.home / "nodes", config=self._embedded_cfg))
                self.embedded = emb
                transport = emb.add_host(self._identity)
                self._bootstrap = [emb.bootstrap_addr]
            else:
                from fusionp2p.net.libp2p_host import Libp2pConfig, open_libp2p_transport

                transport = await stack.enter_async_context(
                    open_libp2p_transport(self._identity, Libp2pConfig(listen=(self._listen,))))
            self._transport = transport
            errors: list[str] = []
            for addr in self._bootstrap:
                try:
                    self._boot_peers.append(await transport.connect(addr))
                except PeerUnavailable as exc:
                    errors.append(exc.reason or str(exc))
            if not self._boot_peers:
                raise PeerUnavailable(self._bootstrap[0].rsplit("/p2p/", 1)[-1], "; ".join(errors))
            # nodes behind NATs are reached by connection reversal through the bootstraps (swarm/reach.py)
            install_reversal(transport, lambda: list(self._boot_peers))
            self._publisher = Publisher(transport, ContentService(transport, ContentStore()), self._boot_peers)
            nursery = await stack.enter_async_context(trio.open_nursery())
            await nursery.start(self._publisher.run)
            self._token = trio.lowlevel.current_trio_token()
            self._nursery = nursery
            self._stop = trio.Event()
            self._ready.set()
            await self._stop.wait()
            nursery.cancel_scope.cancel()

    async def _run_job(self, job: Job, built: BuiltJob) -> None:
        assert self._publisher is not None
        pub = self._publisher
        await self._drive(job, lambda: pub.run_job(built, job._emit, job.home / "checkpoints"))

    async def _drive(self, job: Job, body: Callable[[], Awaitable[None]]) -> None:
        """Run the publisher's side of *job* (submit or attach) with the job's cancel scope; every way it
        ends becomes the job's terminal event."""
        try:
            with trio.CancelScope() as scope:
                job._cancel = scope
                await body()
            if scope.cancelled_caught:
                job._emit(JobStateChanged(job=job.id, state=JobState.CANCELLED.value, reason="cancelled by the publisher",
                                          at=time.time()))
        except Exception as exc:   # never leave the user's wait() hanging
            log.exception("job %s failed", job.id)
            root = _root_error(exc)    # the real error, not "ExceptionGroup: ... (1 sub-exception)"
            job._emit(JobStateChanged(job=job.id, state=JobState.FAILED.value, reason=f"{type(root).__name__}: {root}",
                                      at=time.time()))

    def members(self, timeout: float = 15.0) -> list[str]:
        """Peer ids of the live training nodes that have measured their device profile (the bootstrap's
        verified view; a node's start-up is deferred, swarm/startup.py, and a job published before it ran is
        offered to that node too)."""
        if self._token is None:
            raise JobError("the swarm is closed")
        t = self._transport
        assert t is not None

        async def ask() -> list[str]:
            return sorted((await discover(t, self._boot_peers, timeout=timeout)).members)

        return trio.from_thread.run(ask, trio_token=self._token)

    def job(self, job_id: str, *, timeout: float = 60.0) -> Job:
        """A job this key published earlier, from any machine: follow its events, wait, download, cancel.

        Reads the job's signed spec and status from the swarm; ConfigError when the job is unknown here
        or was published under another key (jobs are controlled only by their publisher's key).
        """
        if self._token is None or self._nursery is None:
            raise JobError("the swarm is closed")
        t, pub = self._transport, self._publisher
        assert t is not None and pub is not None

        async def fetch() -> BuiltJob:
            try:
                with trio.fail_after(timeout):
                    return await read()
            except trio.TooSlowError:
                raise JobError(f"job {job_id}: its spec and model graph did not arrive within {timeout:.0f} s; "
                               "is the swarm reachable (`fusionp2p status`)?") from None

        async def read() -> BuiltJob:
            found = await read_spec(t, job_id)
            if found is None:
                raise ConfigError(f"no job {job_id} in this swarm: check the id with `fusionp2p job list`")
            spec, envelope = found
            if spec.publisher != t.peer_id:
                raise ConfigError(f"job {job_id} was published by {spec.publisher}, not by this key "
                                  f"({t.peer_id}): use the publisher's key (--key)")
            # its members hold its graph too, whether or not the DHT names them (its publisher may be gone)
            st = await JobDriver(t, pub.content, [], None, lambda ev: None, self.home, job=job_id).read_status()
            members = list(st.members) if st is not None else []
            try:
                blob = await pub.content.fetch(spec.model_hash, max_size=1 << 31, holders=members)
            except PeerUnavailable as exc:
                last = f"its last status: {st.state} at step {st.step} of {st.steps}" if st else "it has no status"
                raise JobError(f"job {job_id}: no live node holds its model graph ({exc.reason}); its publisher "
                               f"and its members are gone ({last}), so it can neither finish nor be "
                               "downloaded: submit it again") from None
            dag = decode_dag(blob)
            return BuiltJob(spec=spec, envelope=envelope, blobs={}, dag=dag)

        built = trio.from_thread.run(fetch, trio_token=self._token)
        home = self.home / built.spec.job_id
        home.mkdir(parents=True, exist_ok=True)
        job = Job(self, built, home)
        nursery = self._nursery
        self._call_soon(lambda: nursery.start_soon(self._attach_job, job))
        return job

    async def _attach_job(self, job: Job) -> None:
        assert self._publisher is not None
        pub = self._publisher
        await self._drive(job, lambda: pub.attach_job(job.id, job._emit, job.home / "checkpoints",
                                                       steps=job.spec.config.steps))

    def job_status(self, job_id: str, *, timeout: float = 60.0) -> JobStatus | None:
        """The job's signed status record in the swarm (any key may read it), or None if there is none."""
        if self._token is None:
            raise JobError("the swarm is closed")
        t, pub = self._transport, self._publisher
        assert t is not None and pub is not None

        async def read() -> JobStatus | None:
            with trio.fail_after(timeout):
                return await JobDriver(t, pub.content, [], None, lambda ev: None, self.home, job=job_id).read_status()

        return trio.from_thread.run(read, trio_token=self._token)

    def jobs(self, *, timeout: float = 60.0) -> list[dict[str, Any]]:
        """The jobs this key published (oldest first): id, name, created, and state/step/epoch from the swarm."""
        if self._token is None:
            raise JobError("the swarm is closed")
        t, pub = self._transport, self._publisher
        assert t is not None and pub is not None

        async def ask() -> list[dict[str, Any]]:
            out = []
            with trio.fail_after(timeout):
                for job_id, name, created in await read_index(t, t.peer_id):
                    st = await JobDriver(t, pub.content, [], None, lambda ev: None, self.home, job=job_id).read_status()
                    out.append({"job": job_id, "name": name, "created": created,
                                "state": st.state if st else "unknown", "step": st.step if st else None,
                                "steps": st.steps if st else None, "epoch": st.epoch if st else None,
                                "members": len(set(st.members)) if st else 0,
                                "final_loss": st.final_loss if st else None})
            return out

        return trio.from_thread.run(ask, trio_token=self._token)

    def _call_soon(self, fn: Callable[[], Any]) -> None:
        assert self._token is not None
        trio.from_thread.run_sync(fn, trio_token=self._token)

    # -------------------------------------------------- user API
    def publish(self, *, model: nn.Module, dataset: Dataset | HFTokens | str | os.PathLike[str], config: TrainConfig,
                loss: LossFn | None = None,
                resources: Resources | None = None, name: str = "", weights: str | os.PathLike[str] | None = None) -> Job:
        """Trace *model* (with *loss*, or returning ``(output, loss)``), sign and announce the job.

        *dataset*: ``BuiltinCorpus``/``TokenFile`` (token windows: ``model(x, y)`` or ``loss(model(x), y)``),
        ``Examples`` or a path to a ``.npz``/``.safetensors`` file of named arrays (``model(**batch)``, or
        the fields the loss function names go to it). Raises ConfigError right away when the model
        cannot be traced or the data does not fit it; everything later (no node
        fits, a refused spec, a failed node) ends the job FAILED with the reason.

        *weights*: a safetensors file of the model's ``state_dict`` whose tensors are published instead of
        the module's, read a piece at a time: with the model built under ``fusionp2p.empty_parameters()``
        (its parameters on ``meta``), weights larger than this process's memory (docs/models.md).
        """
        if self._token is None or self._nursery is None:
            raise JobError("the swarm is closed: publish on an open Swarm (Swarm.local(...) or Swarm.connect(...))")
        built = build_job(model, loss, dataset, config, publisher=self._identity.peer_id, sign=self._identity.sign,
                          now=time.time(), nonce=os.urandom(16), resources=resources, name=name, weights=weights)
        return self.publish_built(built)

    def publish_built(self, built: BuiltJob) -> Job:
        """Announce an already built (and signed) job; for tools and tests."""
        home = self.home / built.spec.job_id
        home.mkdir(parents=True, exist_ok=True)
        job = Job(self, built, home)
        nursery = self._nursery
        assert nursery is not None
        self._call_soon(lambda: nursery.start_soon(self._run_job, job, built))
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
        self._token = None       # every later call says "the swarm is closed" (JobError)
        self._nursery = None

    def __enter__(self) -> Swarm:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


__all__ = ["Job", "Swarm", "sites"]


def _root_error(exc: BaseException) -> BaseException:
    """The error a caller wants from a trio exception group: our own (FusionError) first, else the first leaf.

    Under load, libp2p teardown errors can join ours in the group, so a one-member unwrap is not enough.
    """
    from fusionp2p.errors import leaf_errors

    leaves = leaf_errors(exc)
    ours = [e for e in leaves if isinstance(e, FusionError)]
    return ours[0] if ours else leaves[0]
