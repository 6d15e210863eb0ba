"""A live hostile peer against real processes (issue 15): a bootstrap and nodes started through the CLI,
an attacker *process* (``python -m fusionp2p.testing.attacker``) that publishes bad records, offers
bomb DAGs, forges plan records, poisons and hogs probes and floods the data plane, and an honest job
submitted through the CLI on the same swarm meanwhile.

What must hold: every node and the bootstrap stay up and exit cleanly on SIGTERM; no node's resident
memory (``VmRSS``, sampled every 0.25 s) exceeds ``NODE_RSS_BOUND`` (1 GiB; a node idles at about
310 MiB and trains the tiny GPT-2 job at about 400 MiB), the bootstrap stays under
``BOOTSTRAP_RSS_BOUND`` (512 MiB, idles at 95 MiB); the honest job completes; and the nodes' answers
show that the attacks were met and refused (bomb DAGs refused by the budget or by the output-count
bound, tickets refused to a stranger, its offers capped).

The attacks that only hardened decoders survive (a signed record with an infinite memory in its
device profile, a progress event of a bad type: issue 15 item 1, another branch's work) are sent
only when this tree's decoders refuse them; otherwise the test says so in its output.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from fusionp2p.cli.cluster import LocalCluster
from fusionp2p.errors import RemoteProtocolError
from fusionp2p.net.identity import Identity, verify
from fusionp2p.testing.attacks import inf_profile_record
from fusionp2p.wire.records import decode_signed

pytestmark = pytest.mark.system

MiB = 1 << 20
NODE_RSS_BOUND = 1024 * MiB
BOOTSTRAP_RSS_BOUND = 512 * MiB
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}


def decoders_hardened() -> bool:
    """Whether this tree's record decoder refuses the infinite-profile record with RemoteProtocolError."""
    try:
        decode_signed(inf_profile_record(Identity.generate()), verify)
    except RemoteProtocolError:
        return True
    except Exception:
        return False
    return False


def _rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError):
        pass
    return 0


class PeakRss:
    """Samples VmRSS of the given processes in a thread until stopped; the peak of each."""

    def __init__(self, pids: dict[str, int], interval: float = 0.25) -> None:
        self.pids = pids
        self.peak = dict.fromkeys(pids, 0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(interval,), daemon=True)

    def _run(self, interval: float) -> None:
        while not self._stop.wait(interval):
            for name, pid in self.pids.items():
                self.peak[name] = max(self.peak[name], _rss(pid))

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def _attack_and_train(tmp_path: Path, *, nodes: int, duration: float, steps: int) -> None:
    hardened = decoders_hardened()
    if not hardened:
        print("decoders not hardened yet (issue 15 item 1): the infinite-profile record and the bad event "
              "type are left out of this run")
    with LocalCluster(nodes, tmp_path / "cluster", dead_timeout=15.0, probe_interval=5.0) as cluster:
        pids = {name: p.pid for name, p in cluster.procs.items()}
        report = tmp_path / "attack.json"
        args = [sys.executable, "-m", "fusionp2p.testing.attacker", "--bootstrap", cluster.bootstrap,
                "--nodes", str(nodes), "--duration", str(duration), "--report", str(report)]
        with (PeakRss(pids) as rss, open(tmp_path / "attacker.log", "wb") as alog,
              subprocess.Popen([*args, *(["--decoder-attacks"] if hardened else [])], stdout=subprocess.PIPE,
                               stderr=alog, env=ENV, text=True) as attacker):
            try:
                assert attacker.stdout is not None
                line = attacker.stdout.readline()
                assert line.startswith("attacking"), (tmp_path / "attacker.log").read_text()[-3000:]
                # the honest job, published through the CLI, on the swarm under attack
                job = subprocess.run(
                    [sys.executable, "-m", "fusionp2p.cli", "job", "--log-level", "warning", "submit", "--builtin",
                     "gpt2-tiny", "--bootstrap", cluster.bootstrap, "--steps", str(steps), "--out", str(tmp_path / "out")],
                    capture_output=True, text=True, env=ENV, timeout=300)
                assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]
                assert "final eval loss" in job.stdout
                assert (tmp_path / "out" / "model.safetensors").is_file()
                assert attacker.wait(timeout=duration + 120) == 0
            finally:
                if attacker.poll() is None:
                    attacker.kill()
            assert sorted(cluster.alive()) == sorted(pids), cluster.alive()   # every process is still up
        peak = dict(rss.peak)
        print("peak VmRSS (MiB):", {k: v // MiB for k, v in peak.items()})
        assert peak["bootstrap"] < BOOTSTRAP_RSS_BOUND, peak
        assert all(v < NODE_RSS_BOUND for k, v in peak.items() if k != "bootstrap"), peak
        codes = cluster.stop()
        assert set(codes.values()) == {0}, codes
    did = json.loads(report.read_text())
    print("attacker:", json.dumps(did, sort_keys=True))
    answers = did["answers"]
    assert did["did"]["records"] > 0 and did["did"]["probe_reservations"] > 0
    assert answers.get("ticket: granted", 0) == 0 and answers.get("ticket: refused", 0) > 0
    # bomb DAGs are refused for their reason (each bomb's reason: tests/unit/test_dag_bombs.py) until the
    # node's refusals table bans the attacker (its record and ticket floods may get it banned first);
    # after that its offers go unanswered
    refused = [k for k in answers if k.startswith("offer: ") and k != "offer: accepted"]
    assert all("tensors need" in k or "would produce" in k or "unanswered" in k for k in refused), answers
    bombs = sum(v for k, v in answers.items() if k.startswith("offer: ") and k != "offer: accepted")
    assert bombs + answers.get("offer: accepted", 0) == did["did"]["bomb_offers"], answers
    # one publisher holds at most two offers per node however many it sends
    assert answers.get("offer: accepted", 0) <= 2 * nodes, answers


@pytest.mark.heavy
def test_a_hostile_peer_cannot_take_down_or_bloat_a_node_and_a_job_completes(tmp_path: Path) -> None:
    _attack_and_train(tmp_path, nodes=2, duration=30, steps=4)


@pytest.mark.slow
def test_a_longer_attack_on_four_nodes(tmp_path: Path) -> None:
    _attack_and_train(tmp_path, nodes=4, duration=120, steps=30)
