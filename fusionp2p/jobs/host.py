"""What a job run needs of the node's job service: :class:`NodeJobConfig` and the :class:`JobHost` protocol.

``jobs/run.py`` and ``jobs/lead.py`` are typed against this protocol, not against
:class:`~fusionp2p.jobs.node.NodeJobService`, so that the service (which creates the runs) and the runs
do not import each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import trio

from fusionp2p.errors import ConfigError
from fusionp2p.jobs.content import ContentService
from fusionp2p.jobs.events import ProgressEvent
from fusionp2p.jobs.liveness import ProbeConfig
from fusionp2p.jobs.shadow_config import ShadowConfig
from fusionp2p.jobs.store import StoreConfig
from fusionp2p.net.addrs import tcp_endpoint
from fusionp2p.net.bulk import DataPlane, DataPlaneConfig
from fusionp2p.net.resilient import ResilientChannel, ResilientConfig
from fusionp2p.net.transport import Transport
from fusionp2p.swarm.device import check_slowdown
from fusionp2p.swarm.node import SwarmNode


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeJobConfig:
    """Deadlines and limits of a node's job service (seconds)."""

    accept_timeout: float = 300.0      # verify + fetch DAG, weights and data; fetch a stage state
    election_timeout: float = 60.0
    link_timeout: float = 60.0         # all data-plane links of a role set up
    recv_timeout: float = 300.0        # one activation/gradient/averaging message
    report_timeout: float = 15.0
    start_timeout: float = 120.0       # after an epoch ended here: the next start from the leader
    halt_timeout: float = 30.0         # a member answers an immediate halt
    conclude_timeout: float = 120.0    # leader: every stage's done report after its own
    watch_interval: float = 1.0        # the leader looks at the membership view this often (and on changes)
    status_interval: float = 10.0      # the leader refreshes the job's status record this often
    # a loss-stage replica gossips its progress at most this often, the steps between in one message
    # (StepProgress.earlier; 0: every step on its own)
    progress_interval: float = 1.0
    offer_retry: float = 60.0          # a node that refused (or did not answer) an offer is asked again after
    offer_ttl: float = 600.0           # an accepted offer that no start follows is forgotten
    max_offers_per_publisher: int = 2  # offers one peer has pending here (fetching or not started) at once
    replan_retry: float = 20.0         # a leader whose proposed epoch did not take off proposes again after
    # a member the membership view calls dead is asked directly before a re-plan (jobs/lead.py
    # _confirm_gone): it has confirm_timeout to answer, and an answer counts for confirm_ttl
    confirm_timeout: float = 3.0
    confirm_ttl: float = 10.0
    join_check_interval: float = 5.0   # the leader judges the same joiners (plans with and without them) this often,
    join_check_max: float = 60.0       # backing off up to this while they are of no use (jobs/lead.py)
    # once an epoch has trained rebalance_after steps, its leader re-plans by the speeds the members measured
    # while training when that is predicted faster (jobs/rebalance.py), at most rebalance_max times a job
    rebalance_after: int = 20
    rebalance_max: int = 1
    # a planned re-plan (joiners taken in, a re-balance) must save this many seconds of the steps left at the
    # predicted rates; while less than this is left at the rate the job trains, the leader neither offers
    # the job to standbys nor weighs plans (jobs/lead.py _replan_may_pay)
    replan_min_saving: float = 30.0
    max_jobs: int = 4                  # offered or running at once
    max_pending_links: int = 64
    max_state_bytes: int = 16 << 30    # a stage state fetched from a member
    # the content store's caps (``--disk``; jobs/store.py: what is pinned, what is cached and evicted)
    store: StoreConfig = field(default_factory=StoreConfig)
    # background copies of every single-replica stage's state to another node (jobs/shadow.py)
    shadow: ShadowConfig = field(default_factory=ShadowConfig)
    # a lost link's peer asked directly; a refusal starts the re-plan before the view's timeout (jobs/liveness.py)
    probes: ProbeConfig = field(default_factory=ProbeConfig)
    data_plane: DataPlaneConfig = field(default_factory=lambda: DataPlaneConfig(keepalive=1.0, dead_after=60.0))
    # How long a lost data-plane connection between two live nodes may take to come back (the channel
    # reconnects, resumes and resends what the peer missed; docs/dataplane.md "Reconnecting channels").
    # A peer the membership view declares dead is not waited for (``peer_gone``): the job re-plans.
    reconnect_timeout: float = 60.0
    # The data plane's TCP address (``--data-listen``; None: any free port where the libp2p transport
    # listens) and the one peers are told to dial (``--data-announce``: a NAT's or container's published
    # address; None: the bound one). Multiaddrs, the rules of --listen / --announce-addr (docs/networking.md).
    data_listen: str | None = None
    data_announce: str | None = None
    # emulation of a slower accelerator (``--emulate-slowdown``, the testbed's ``slowdown``): every forward,
    # backward and optimizer step takes this many times what it takes at the host's CPU share of
    # ``compute_cpus`` cores (None: unknown, its wall time; StageContext.compute_slowdown)
    compute_slowdown: float = 1.0
    compute_cpus: float | None = None
    # where this node's stages compute (``--device``: "cpu" or "cuda:N"; the executor, its optimizer and
    # the parameters live there; fusionp2p/device.py moves what crosses to the host and back)
    device: str = "cpu"

    def __post_init__(self) -> None:
        try:
            kind = torch.device(self.device).type
        except (RuntimeError, ValueError):
            kind = ""
        if kind not in ("cpu", "cuda"):
            raise ConfigError(f"NodeJobConfig.device must be cpu or cuda:N, got {self.device!r}")
        check_slowdown(self.compute_slowdown)
        if self.compute_cpus is not None and not 0.0 < self.compute_cpus <= 1024.0:
            raise ConfigError("the CPU share of an emulated slowdown must be in (0, 1024] cores")
        if self.data_listen is not None:
            tcp_endpoint(self.data_listen, "--data-listen")
        if self.data_announce is not None:
            tcp_endpoint(self.data_announce, "--data-announce", announce=True)
        for name in ("accept_timeout", "election_timeout", "link_timeout", "recv_timeout", "report_timeout",
                     "reconnect_timeout", "start_timeout", "halt_timeout", "conclude_timeout", "watch_interval",
                     "status_interval", "offer_retry", "offer_ttl", "replan_retry", "confirm_timeout",
                     "confirm_ttl", "join_check_interval", "join_check_max", "replan_min_saving"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"NodeJobConfig.{name} must be positive")
        if not self.progress_interval >= 0:
            raise ConfigError("NodeJobConfig.progress_interval must be >= 0")
        if self.rebalance_after < 1 or self.rebalance_max < 0:
            raise ConfigError("NodeJobConfig.rebalance_after must be >= 1 and rebalance_max >= 0")
        if self.max_jobs < 1 or self.max_pending_links < 1 or self.max_offers_per_publisher < 1:
            raise ConfigError("NodeJobConfig.max_jobs, max_pending_links and max_offers_per_publisher must be >= 1")

    def channels(self) -> ResilientConfig:
        """Settings of a job's data-plane channels (both the dialing and the accepting side).

        ``copy_on_send=False``: sent tensors are kept by reference for retransmission, not cloned;
        nothing the job sends is modified in place after ``send`` returns (docs/dataplane.md
        "Reconnecting channels"; checked by tests/integration/test_e2e_local.py
        ``test_sent_tensors_are_never_modified_after_send``).
        """
        return ResilientConfig(reconnect_timeout=self.reconnect_timeout, copy_on_send=False)


class JobHost(Protocol):
    """The node's job service as a job run sees it (implemented by ``NodeJobService``)."""

    swarm: SwarmNode
    transport: Transport
    config: NodeJobConfig
    content: ContentService
    planning: trio.CapacityLimiter   # the node's plans are made in a thread under it (jobs/plan_thread.py)

    @property
    def nursery(self) -> trio.Nursery: ...

    @property
    def data_plane(self) -> DataPlane: ...

    async def handle(self, peer: str, req: dict[str, Any]) -> dict[str, Any]: ...

    def subscribe_job(self, job: str) -> trio.MemoryReceiveChannel[tuple[str, ProgressEvent]]: ...

    def peer_gone(self, peer: str) -> bool: ...

    def suspect(self, peer: str) -> None: ...

    def confirmed_dead(self, peer: str) -> bool: ...

    async def probe(self, peer: str) -> None: ...

    async def claim(self, job: str, name: str, peer: str, *, alive: Any) -> ResilientChannel: ...

    def drop_arrived(self, job: str, *, older_than: int) -> None: ...


__all__ = ["JobHost", "NodeJobConfig"]
