"""The ops server over real HTTP on loopback, beside a real libp2p swarm in one trio.run: /api and
/metrics reflect the members, the bandwidth matrix, both planes' traffic, the jobs and their gossip."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from functools import partial
from typing import Any

import torch
import trio
import trio.testing
from prometheus_client.parser import text_string_to_metric_families

from fusionp2p.jobs.events import StepProgress, encode_event
from fusionp2p.jobs.status import JobView, StepStats
from fusionp2p.net.bulk import open_data_plane
from fusionp2p.net.channel import TensorMessage
from fusionp2p.ops import HttpConfig, serve_ops
from fusionp2p.plan.plan import Fence, Plan, Stage
from fusionp2p.testing.swarm import converge, local_swarm
from fusionp2p.types import AveragingStats
from fusionp2p.wire.protocols import TOPIC_JOBS


class Jobs:
    def __init__(self, rows: list[JobView]) -> None:
        self.rows = rows

    def status(self) -> list[JobView]:
        return self.rows


def get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return int(r.status), bytes(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def test_api_and_metrics_of_a_live_swarm() -> None:
    async def main() -> dict[str, Any]:
        with trio.fail_after(90):
            async with local_swarm(2) as (boot, nodes):
                await converge(nodes, bandwidth=True, timeout=45)
                a, b = nodes
                plan = Plan(job="j1", epoch=0, snapshot_hash="s", algorithm="op-fence", seed=0, n_units=4, micro_batches=2,
                            stages=(Stage(start=0, end=2, replicas=(a.peer_id,)), Stage(start=2, end=4, replicas=(b.peer_id,))),
                            fences=(Fence(index=0, unit=2, dense_bytes=1e6, rho=0.25),))
                last = StepStats(step=6, stage=0, replica=0, wall_s=0.5, compute_s=0.4, tokens=1000,
                                 averaging=AveragingStats(rounds=3, skipped=1, seconds=0.9, last_s=0.2))
                jobs = Jobs([JobView(job="j1", state="running", publisher=b.peer_id, steps=10, role=(0, 0), plan=plan,
                                       last=last)])
                async with trio.open_nursery() as n:
                    url = await n.start(partial(serve_ops, a, HttpConfig(port=0), jobs=jobs))
                    # data-plane traffic: one 4 MB message a -> b
                    async with open_data_plane(a.transport) as da, open_data_plane(b.transport) as db:
                        ch = await da.connect(b.peer_id)
                        back = await db.incoming.receive()
                        await ch.send(TensorMessage(job="j1", kind="act", tensors=(torch.zeros(1_000_000),)))
                        await back.receive()
                    # progress gossip: published by a, delivered to a's own subscribers at once
                    for i in range(3):
                        await a.transport.publish(TOPIC_JOBS, encode_event(
                            StepProgress(job="j1", step=i, peer=a.peer_id, loss=3.0 - i, tokens_per_s=500.0)))
                    await trio.testing.wait_all_tasks_blocked(cushion=0.05)
                    out: dict[str, Any] = {"url": url, "a": a.peer_id, "b": b.peer_id, "boot": boot.peer_id,
                                           "control": a.transport.traffic.snapshot().get(("control", b.peer_id))}
                    out["status"] = await trio.to_thread.run_sync(get, url + "api/status")
                    out["metrics"] = await trio.to_thread.run_sync(get, url + "metrics")
                    out["page"] = await trio.to_thread.run_sync(get, url)
                    n.cancel_scope.cancel()
                return out

    out = trio.run(main)
    a, b = out["a"], out["b"]
    assert out["url"].startswith("http://127.0.0.1:")
    sent, received = out["control"]
    assert sent > 1000 and received > 1000                     # libp2p bytes counted at the connection

    code, body = out["status"]
    assert code == 200
    s = json.loads(body)
    assert s["node"]["peer"] == a and s["alive_by_role"] == {"node": 2, "bootstrap": 1}
    assert {m["peer"] for m in s["members"]} == {a, b, out["boot"]}
    assert s["bandwidth"]["peers"] == sorted([a, b]) and s["bandwidth"]["measured"][0][1]
    job = s["jobs"][0]
    assert job["job"] == "j1" and job["state"] == "running" and job["role"] == [0, 0]
    assert [p[0] for p in job["progress"]["curve"]] == [0, 1, 2] and job["progress"]["loss"] == 1.0
    assert job["plan"]["fences"][0]["rho"] == 0.25 and job["plan"]["stages"][1]["replicas"] == [b]
    assert job["local"]["tokens_per_s"] == 2000.0 and job["local"]["averaging"]["rounds"] == 3

    code, text = out["metrics"]
    assert code == 200
    m = samples(text.decode())
    assert m[("fusionp2p_members", (("role", "node"),))] == 2
    assert m[("fusionp2p_traffic_sent_bytes_total", (("peer", b), ("plane", "data")))] > 4_000_000
    assert m[("fusionp2p_traffic_received_bytes_total", (("peer", b), ("plane", "control")))] > 1000
    assert m[("fusionp2p_bandwidth_bytes_per_second", (("dst", b), ("measured", "yes"), ("src", a)))] > 0
    assert m[("fusionp2p_jobs", (("state", "running"),))] == 1
    assert m[("fusionp2p_job_step", (("job", "j1"),))] == 2
    assert m[("fusionp2p_job_loss", (("job", "j1"),))] == 1.0
    assert m[("fusionp2p_job_step_seconds", (("job", "j1"), ("stage", "0")))] == 0.5
    assert m[("fusionp2p_job_compute_utilisation", (("job", "j1"), ("stage", "0")))] == 0.8
    assert m[("fusionp2p_averaging_rounds_total", (("job", "j1"), ("outcome", "complete"), ("stage", "0")))] == 3
    assert m[("fusionp2p_fence_kept_ratio", (("fence", "0"), ("job", "j1")))] == 0.25

    code, page = out["page"]
    assert code == 200 and b'<script src="/static/dashboard.js"' in page
