"""Compute abandoned to a worker thread by a cancelled wait is counted, and the process's exit waits for it
(``fusionp2p/threads.py``): a daemon thread still in C++ when the interpreter finalizes aborts the process."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import trio

from fusionp2p import threads


def test_an_abandoned_call_is_counted_until_its_function_ends() -> None:
    release = threading.Event()
    started = threading.Event()

    def work() -> int:
        started.set()
        release.wait(10)
        return 1

    async def main() -> None:
        with trio.fail_after(10):
            with trio.move_on_after(0.05):
                await threads.run_abandonable(work)
            assert started.is_set()

    trio.run(main)
    assert threads.running() == 1                         # abandoned by the deadline, still running
    assert not threads.wait_for_abandoned(0.05)
    release.set()
    assert threads.wait_for_abandoned(10)
    assert threads.running() == 0


def test_the_process_exit_waits_for_an_abandoned_call(tmp_path: Path) -> None:
    """On the old code (a plain ``abandon_on_cancel`` thread) the interpreter exits under the daemon thread and
    the file is never written."""
    out = tmp_path / "done"
    script = textwrap.dedent(f"""
        import time, trio
        from fusionp2p.threads import run_abandonable

        def work():
            time.sleep(0.5)
            open({str(out)!r}, "w").write("finished")

        async def main():
            with trio.move_on_after(0.01):
                await run_abandonable(work)

        trio.run(main)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=60)
    assert proc.returncode == 0, proc.stderr.decode()
    assert out.read_text() == "finished"
