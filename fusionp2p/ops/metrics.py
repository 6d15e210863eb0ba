"""``/metrics``: the node's state in the Prometheus text format (prometheus_client does the format).

A custom collector turns one :meth:`OpsState.snapshot` into metric families at scrape time, so
nothing in the node updates a gauge as it goes and ``/api`` and ``/metrics`` never disagree. Each
scrape has its own registry (no process-wide one): many nodes can share a process.

Names (all prefixed ``fusionp2p_``; peers are full peer ids, jobs their ids):

==================================================  =====================================================
``members{role}``                                   live members by role; ``members_dead`` the dead
``traffic_{sent,received}_bytes_total{peer,plane}``  bytes per peer, plane ``control`` (libp2p) or ``data``
``bandwidth_bytes_per_second{src,dst,measured}``    the bandwidth matrix (measured, or estimated)
``rtt_seconds{src,dst}``                            probed round-trip times
``jobs{state}``                                     this node's jobs by state
``job_step{job}``, ``job_loss{job}``                latest step and loss in the swarm's gossip
``job_eval_loss{job}``                              latest held-out loss in the swarm's gossip
``job_tokens_per_second{job,source}``               swarm (loss stage, gossip) and local (this replica)
``job_step_seconds{job,stage}``                     this node's latest step time
``job_compute_utilisation{job,stage}``              compute seconds / step seconds, this node
``averaging_rounds_total{job,stage,outcome}``       CO2 rounds of this replica, ``complete``/``skipped``
``averaging_seconds_total{job,stage}``              their summed duration; ``..._last_seconds`` the latest
``fence_kept_ratio{job,fence}``                     AdaTopK kept fraction per fence of the adopted plan
``refused_messages_total{reason}``                  input refused from peers, per reason
==================================================  =====================================================
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from fusionp2p.jobs.lifecycle import JobState

P = "fusionp2p_"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class SnapshotCollector(Collector):
    """Metric families from one snapshot of :class:`fusionp2p.ops.state.OpsState` (see the module doc)."""

    def __init__(self, snapshot: Callable[[], dict[str, Any]]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        s = self._snapshot()
        node = s["node"]
        info = InfoMetricFamily(P + "node", "this node", labels=["peer", "role"])
        info.add_metric([node["peer"], node["role"]], {})
        yield info
        yield GaugeMetricFamily(P + "uptime_seconds", "seconds since the node started", value=node["uptime_s"])
        yield from _members(s)
        yield from _traffic(s)
        yield from _bandwidth(s)
        yield from _jobs(s)
        yield from _refusals(s)


def _members(s: dict[str, Any]) -> Iterator[Metric]:
    g = GaugeMetricFamily(P + "members", "live members by role", labels=["role"])
    for role in sorted({"node", "bootstrap", *s["alive_by_role"]}):
        g.add_metric([role], s["alive_by_role"].get(role, 0))
    yield g
    yield GaugeMetricFamily(P + "members_dead", "members whose heartbeats stopped", value=s["dead"])


def _traffic(s: dict[str, Any]) -> Iterator[Metric]:
    sent = CounterMetricFamily(P + "traffic_sent_bytes", "bytes sent per peer and plane", labels=["peer", "plane"])
    recv = CounterMetricFamily(P + "traffic_received_bytes", "bytes received per peer and plane", labels=["peer", "plane"])
    for row in s["traffic"]:
        sent.add_metric([row["peer"], row["plane"]], row["sent"])
        recv.add_metric([row["peer"], row["plane"]], row["received"])
    yield sent
    yield recv


def _bandwidth(s: dict[str, Any]) -> Iterator[Metric]:
    bw = GaugeMetricFamily(P + "bandwidth_bytes_per_second", "link bandwidth, probed (measured=yes) or estimated",
                           labels=["src", "dst", "measured"])
    rtt = GaugeMetricFamily(P + "rtt_seconds", "probed round-trip time", labels=["src", "dst"])
    m = s["bandwidth"]
    peers = m["peers"]
    for i, a in enumerate(peers):
        for j, b in enumerate(peers):
            v = m["bytes_per_s"][i][j]
            if v is not None:
                bw.add_metric([a, b, "yes" if m["measured"][i][j] else "no"], v)
            r = m["rtt_s"][i][j]
            if r is not None:
                rtt.add_metric([a, b], r)
    yield bw
    yield rtt


def _jobs(s: dict[str, Any]) -> Iterator[Metric]:
    states = GaugeMetricFamily(P + "jobs", "this node's jobs by state", labels=["state"])
    for st in JobState:
        states.add_metric([st.value], s["jobs_by_state"].get(st.value, 0))
    yield states
    step = GaugeMetricFamily(P + "job_step", "latest step reported in gossip", labels=["job"])
    loss = GaugeMetricFamily(P + "job_loss", "latest training loss reported in gossip", labels=["job"])
    held = GaugeMetricFamily(P + "job_eval_loss", "latest held-out loss reported in gossip", labels=["job"])
    tps = GaugeMetricFamily(P + "job_tokens_per_second", "throughput: the loss stage's (swarm) or this replica's (local)",
                            labels=["job", "source"])
    step_s = GaugeMetricFamily(P + "job_step_seconds", "this node's latest step time", labels=["job", "stage"])
    util = GaugeMetricFamily(P + "job_compute_utilisation", "compute seconds over step seconds, this node",
                             labels=["job", "stage"])
    rounds = CounterMetricFamily(P + "averaging_rounds", "CO2 averaging rounds of this replica", labels=["job", "stage", "outcome"])
    avg_s = CounterMetricFamily(P + "averaging_seconds", "summed duration of the averaging rounds", labels=["job", "stage"])
    avg_last = GaugeMetricFamily(P + "averaging_last_seconds", "duration of the latest averaging round", labels=["job", "stage"])
    rho = GaugeMetricFamily(P + "fence_kept_ratio", "AdaTopK kept fraction per fence of the adopted plan (1: dense)",
                            labels=["job", "fence"])
    for j in s["jobs"]:
        job = j["job"]
        pr = j["progress"]
        if pr is not None and pr["step"] >= 0:
            step.add_metric([job], pr["step"])
            if pr["loss"] is not None:
                loss.add_metric([job], pr["loss"])
        if pr is not None and pr.get("eval_loss") is not None:
            held.add_metric([job], pr["eval_loss"])
            tps.add_metric([job, "swarm"], pr["tokens_per_s"])
        loc = j["local"]
        if loc is not None:
            stage = str(loc["stage"])
            tps.add_metric([job, "local"], loc["tokens_per_s"])
            step_s.add_metric([job, stage], loc["step_s"])
            util.add_metric([job, stage], loc["compute_util"])
            if loc["averaging"] is not None:
                a = loc["averaging"]
                rounds.add_metric([job, stage, "complete"], a["rounds"])
                rounds.add_metric([job, stage, "skipped"], a["skipped"])
                avg_s.add_metric([job, stage], a["seconds"])
                avg_last.add_metric([job, stage], a["last_s"])
        if j["plan"] is not None:
            for f in j["plan"]["fences"]:
                rho.add_metric([job, str(f["index"])], f["rho"])
    yield from (step, loss, held, tps, step_s, util, rounds, avg_s, avg_last, rho)


def _refusals(s: dict[str, Any]) -> Iterator[Metric]:
    c = CounterMetricFamily(P + "refused_messages", "messages refused from peers, per reason", labels=["reason"])
    r = s["refusals"]
    if r is not None:
        for reason, n in sorted(r["by_reason"].items()):
            c.add_metric([reason], n)
    yield c


def render(snapshot: Callable[[], dict[str, Any]]) -> bytes:
    """The Prometheus text exposition of one snapshot."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(snapshot))
    return generate_latest(registry)


__all__ = ["CONTENT_TYPE", "SnapshotCollector", "render"]
