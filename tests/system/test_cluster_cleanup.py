"""``LocalCluster`` starts its processes in their own sessions; a SIGTERM to the process that holds the cluster
(a CI timeout, ``kill PID`` on a benchmark) must still stop them, not leave a swarm running on the machine."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.system

HOLDER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from fusionp2p.cli.cluster import LocalCluster
    with LocalCluster(1, Path(sys.argv[1])) as c:
        print(" ".join(str(p.pid) for p in c.procs.values()), flush=True)
        time.sleep(120)
""")


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_sigterm_to_the_holder_stops_the_cluster(tmp_path: Path) -> None:
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    pids: list[int] = []
    try:
        assert holder.stdout is not None
        pids = [int(p) for p in holder.stdout.readline().split()]
        assert len(pids) == 2, "the holder printed no bootstrap and node pids"
        holder.send_signal(signal.SIGTERM)
        assert holder.wait(timeout=60) == 128 + signal.SIGTERM
        assert [p for p in pids if _running(p)] == []     # reaped by the holder's stop(), not orphaned
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
        for pid in pids:                  # the processes this test started, by PID, if the cluster left them
            if _running(pid):
                os.kill(pid, signal.SIGKILL)
