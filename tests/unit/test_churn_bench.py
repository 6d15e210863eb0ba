"""benchmarks.churn's bookkeeping: samples per plan (the equal-samples check) and a quiet run's ticks."""

from __future__ import annotations

import dataclasses
import datetime
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from benchmarks.churn import (
    BENCH,
    MACHINE,
    WARMUP,
    _events,
    breakdown,
    first_windows,
    job_config,
    per_epoch,
    ready_after,
    renice,
    samples,
    settle,
    spikes,
)
from fusionp2p.cli.demo import SEQ_LEN, demo_model
from fusionp2p.data import BuiltinCorpus
from fusionp2p.jobs.build import build_job, choose_plan
from fusionp2p.jobs.events import JobStateChanged
from fusionp2p.net.identity import Identity
from fusionp2p.testing.swarm import TEST_PROFILE


def test_samples_add_up_each_plans_steps_times_its_replicas() -> None:
    per = 4 * 8   # micro-batches x micro-batch
    assert samples([(0, [2, 2], 0)], 300, per) == 300 * 2 * per
    # a plan of one stage x 2 replicas from step 40, then 2 x 2 again from step 85: still 2 replicas a step
    assert samples([(0, [2, 2], 0), (1, [2], 40), (2, [2, 2], 85)], 100, per) == 100 * 2 * per
    # a plan of 1 replica per stage for 20 steps trains fewer samples: the held-out losses are not comparable
    assert samples([(0, [2, 2], 0), (1, [1, 1], 40), (2, [2, 2], 60)], 100, per) == (80 * 2 + 20) * per


def test_spikes_are_the_steps_well_above_the_lowest_of_the_five_before() -> None:
    """Issue 41: the calm run of 1 x 2 replicas in lockstep spiked at step 8 (5.03 after 3.67) and ended 14% above
    a churn run that did not; the benchmark lists such steps. The measured curve's first 14 steps."""
    curve = [5.57, 5.02, 4.72, 4.44, 4.22, 3.98, 3.81, 3.67, 5.03, 4.04, 3.42, 3.42, 3.37, 4.44]
    assert spikes(dict(enumerate(curve))) == [(8, 5.03, 1.37), (13, 4.44, 1.32)]
    smooth = [5.57, 5.02, 4.73, 4.43, 4.22, 3.98, 3.81, 3.68, 3.58, 3.46, 3.38, 3.36, 3.63, 3.23]   # no spike
    assert spikes(dict(enumerate(smooth))) == []
    assert spikes(dict.fromkeys(range(4), 9.0) | {4: 20.0}) == []   # fewer than five steps before it: not judged


def test_the_job_warms_its_learning_rate_up() -> None:
    """Without a warm-up the demo's lr (2e-3 from step 0) spiked: the warm-up ramps it over WARMUP steps, then
    the demo's cosine."""
    cfg = job_config(600, 1)
    assert WARMUP > 0 and cfg.lr_sched is not None and cfg.lr_sched.warmup_steps == WARMUP
    assert cfg.lr_at(0) == cfg.lr / WARMUP and cfg.lr_at(WARMUP) == cfg.lr
    assert job_config(600, 1, warmup=0).lr_at(0) == cfg.lr


class _Job:
    """Job.events' contract: events in order, TimeoutError when none comes within the timeout."""

    def __init__(self, evs: list[object]) -> None:
        self.feed = iter(evs)

    def events(self, timeout: float) -> Iterator[object]:
        while True:
            nxt = next(self.feed)
            if nxt is None:
                raise TimeoutError
            yield nxt
            if isinstance(nxt, JobStateChanged):
                return


def test_a_quiet_job_yields_ticks_and_the_events_go_on_after_them() -> None:
    done = JobStateChanged(job="j", state="done", reason="", at=0.0)
    assert list(_events(_Job(["a", None, None, "b", done]), 0.01)) == ["a", None, None, "b", done]


def test_both_runs_plan_one_stage_of_two_replicas_whatever_the_members() -> None:
    """Issue 41: the calm and churn runs planned different layouts (1 x 2, and 2 x 2 then 1 x 2), so goodput
    compared layouts. The benchmark's job pins it: for 2 to 5 members of unequal measured speed (a fresh
    node measured slower or faster than the rest), every plan is 1 stage x 2 replicas."""
    torch.set_num_threads(1)
    me = Identity.generate()
    cfg = job_config(30, 1)
    assert (cfg.stages, cfg.replicas) == (1, 2)
    built = build_job(demo_model(), None, BuiltinCorpus(seq_len=SEQ_LEN), cfg, publisher=me.peer_id,
                      sign=me.sign, now=1.7e9, nonce=b"c" * 16)
    for n in (2, 3, 5):
        members = {f"12D3KooW{i:040d}": dataclasses.replace(TEST_PROFILE, flops_fp32=TEST_PROFILE.flops_fp32 * f)
                   for i, f in enumerate([1.0, 0.6, 1.7, 0.9, 1.3][:n])}
        plan = choose_plan(built.spec, built.dag, members)
        assert [len(s.replicas) for s in plan.stages] == [2], (n, plan.stages)


def test_the_breakdown_puts_each_process_cpu_in_its_window_and_role() -> None:
    """Issue 41: where a churn run's CPU went. Two members train from 0 s (1 CPU-s a second each), a standby
    idles (0.1), node5 starts at 35 s (a kill at 30 s) and spends 4 CPU-s in its first 4 s; from 40 s it
    replaces node1 in the plan. A step a second."""
    def ramp(rate: float, t0: float = 0.0, t1: float = 100.0, burst: tuple[float, float] = (0.0, 0.0)
             ) -> list[tuple[float, float]]:
        out, cpu = [], 0.0
        for k in range(int(t0), int(t1)):
            cpu += rate + (1.0 if burst[0] <= k < burst[1] else 0.0)
            out.append((k + 1.0, cpu))
        return out

    series = {"node0": ramp(1.0), "node1": ramp(1.0, t1=30), "node2": ramp(0.1), "bootstrap": ramp(0.01),
              "node5": [(t, c) for t, c in ramp(1.0, 35, 100, burst=(35, 38)) if t > 35]}
    plans = [(0.0, ["node0", "node1"]), (40.0, ["node0", "node5"])]
    out = breakdown(series, start=0.0, end=100.0, kills=[30.0], joins={"node5": 35.0}, plans=plans,
                    step_at={s: s + 0.5 for s in range(100)})
    assert out["all"]["s"] == 100.0 and out["all"]["steps"] == 100
    # a kill's 20 s and the fresh node's first 20 s overlap: [30, 55) is outside "between"
    assert (out["after_kill"]["s"], out["joiner_start"]["s"], out["between"]["s"]) == (20.0, 20.0, 75.0)
    # node5 is a joiner until the plan names it at 40 s: its start-up burst (readings at 36-39: 2, 2, 2, 1)
    assert out["joiner_start"]["cpu_s"]["joiner"] == 7.0
    assert out["all"]["cpu_s"]["standbys"] == 10.0 and out["all"]["cpu_s"]["bootstrap"] == 1.0
    # between: node0 75 s, node1 until its death at 30 s (29 readings), node5 from 55 s (46)
    assert out["between"]["cpu_s"]["members"] == 150.0 and out["between"]["steps"] == 75
    assert out["between"]["cpu_s_per_step"]["all"] == round((150.0 + 7.5 + 0.75) / 75, 3)
    # after the kill: node0's 20 s, node1's last reading (at 30 s), node5 from 40 s
    assert out["after_kill"]["cores"]["members"] == round((20 + 1 + 10) / 20, 3)

def test_the_first_windows_say_where_the_cpu_went_outside_the_nodes() -> None:
    """Issue 41: the full rate's churn run trained its first 80 s at 2/3 of the calm run's rate, its nodes' CPU a
    step nearly equal. Per 20 s: each node's CPU-s, this process's, and the machine's beyond both. Readings
    every second from -10 s: two members at 1 core, the machine 2 cores busy from 20 s (0.5 outside before)."""
    def line(rate: float, t0: float = -10.0, extra: tuple[float, float, float] = (0.0, 0.0, 0.0)) -> list[tuple[float, float]]:
        out, cpu = [], 0.0
        for k in range(int(t0), 100):
            cpu += rate + (extra[2] if extra[0] <= k < extra[1] else 0.0)
            out.append((k + 1.0, cpu))
        return out

    series = {"node0": line(1.0), "node1": line(1.0), BENCH: line(0.05), MACHINE: line(2.55, extra=(20, 100, -0.5)),
              "node5": line(0.5, t0=30.0)}   # a process started later counts from 0
    rows = first_windows(series, start=0.0, step_at={s: s * 0.5 for s in range(200)})
    assert [r["from_s"] for r in rows] == [0.0, 20.0, 40.0, 60.0] and [r["steps"] for r in rows] == [40] * 4
    assert rows[0]["nodes"] == 40.0 and rows[0]["cpu_s"][BENCH] == 1.0 and rows[0]["outside"] == 10.0
    assert rows[1]["cpu_s"]["node5"] == 5.0 and rows[1]["nodes"] == 45.0 and rows[1]["outside"] == -5.0
    assert rows[2]["outside"] == -10.0   # node5 a core's half: the machine's 2.05 spent by the nodes and us


def test_settle_waits_for_a_quiet_machine_and_no_longer_than_its_timeout() -> None:
    """Each run starts once the machine's CPU outside the benchmark is quiet (the calm run's exit, another
    program), or after the timeout; the result records the wait and the cores busy."""
    t = [0.0]
    rates = iter([1.5, 1.2, 0.8, 0.1, 0.1])
    used = [0.0]

    def busy() -> float:
        return used[0]

    def sleep(dt: float) -> None:
        t[0] += dt
        used[0] += next(rates) * dt

    assert settle(busy, quiet=0.3, timeout=60.0, clock=lambda: t[0], sleep=sleep) == {"waited_s": 4.0, "cores": 0.1}
    t[0], rates = 0.0, iter([1.0] * 100)
    assert settle(busy, quiet=0.3, timeout=5.0, clock=lambda: t[0], sleep=sleep) == {"waited_s": 5.0, "cores": 1.0}


def test_per_epoch_rates_come_with_their_deal() -> None:
    step_at = {s: 0.5 * s for s in range(10)} | {s: 10.0 + s for s in range(10, 15)}
    epochs = dict.fromkeys(range(10), 0) | dict.fromkeys(range(10, 15), 1)
    assert per_epoch(step_at, epochs, [(0, []), (1, [4.5, 3.5])]) == [
        {"epoch": 0, "first_step": 0, "steps": 10, "span_s": 4.5, "steps_per_s": 2.0, "deal": []},
        {"epoch": 1, "first_step": 10, "steps": 5, "span_s": 4.0, "steps_per_s": 1.0, "deal": [4.5, 3.5]}]


def test_renice_sets_every_thread_of_a_process_and_back() -> None:
    """``--joiner-nice``: a fresh node's start-up runs nicer, then at the others' priority (CAP_SYS_NICE to go back)."""
    code = "import threading, time; threading.Thread(target=time.sleep, args=(30,)).start(); print(1, flush=True); time.sleep(30)"
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    try:
        assert p.stdout is not None and p.stdout.readline() == b"1\n"   # its second thread runs
        base = os.getpriority(os.PRIO_PROCESS, p.pid)
        tids = [int(t.name) for t in Path(f"/proc/{p.pid}/task").iterdir()]
        assert len(tids) == 2
        renice(p.pid, base + 5)
        assert [os.getpriority(os.PRIO_PROCESS, t) for t in tids] == [base + 5] * 2
        try:
            renice(p.pid, base)
        except PermissionError:
            pytest.skip("lowering a nice value needs CAP_SYS_NICE")
        assert [os.getpriority(os.PRIO_PROCESS, t) for t in tids] == [base] * 2
    finally:
        p.kill()
        p.wait()
    renice(p.pid, base)   # killed and reaped: nothing to set, no error


def test_a_fresh_nodes_start_up_lasts_until_it_holds_the_job(tmp_path: Path) -> None:
    start = datetime.datetime(2026, 11, 29, 19, 0, 0).timestamp()
    (tmp_path / "node5.log").write_text("2026-11-29 19:00:09,500 INFO fusionp2p.jobs.node: job service ready\n"
                                        "2026-11-29 19:00:42,250 INFO fusionp2p.jobs.node: accepted job ab from cd\n"
                                        "2026-11-29 19:01:42,250 INFO fusionp2p.jobs.node: accepted job ab from ef\n")
    (tmp_path / "node6.log").write_text("2026-11-29 19:00:09,500 INFO fusionp2p.jobs.node: job service ready\n")
    assert ready_after(tmp_path, {"node5": start, "node6": start, "node7": start}) == {"node5": 42.2}
