"""README.md runs as written: its Python example trains on ``Swarm.local`` and prints one readable line
per event, its ``make_job()`` file builds a job, and every shell command it shows parses (``fusionp2p``
against the real argument parser, ``make`` as a dry run). Everything is read from README.md itself."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from fusionp2p.cli.main import build_parser

pytestmark = pytest.mark.system

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def blocks(lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", README, re.M | re.S)


def commands() -> list[str]:
    """Every command line of the README's bash blocks (continuations joined, comments dropped)."""
    out = []
    for block in blocks("bash"):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" # ", 1)[0].split("   #", 1)[0].strip()
            if line and not line.startswith("#"):
                out.append(line)
    return out


@pytest.mark.timeout(300)
def test_the_python_example_trains_on_swarm_local_and_prints_one_line_per_event(tmp_path: Path) -> None:
    example = next(b for b in blocks("python") if "Swarm.local" in b)
    (tmp_path / "example.py").write_text(example)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "example.py"], cwd=tmp_path, capture_output=True, text=True, env=env,
                       timeout=280)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.splitlines()
    assert lines and all(ln.startswith("job ") and len(ln) < 300 for ln in lines), r.stdout
    assert not any("StepProgress(" in ln or "PlanChanged(" in ln for ln in lines)   # str(event), not a repr
    assert any(" plan " in ln and "predicted" in ln for ln in lines)
    steps = [ln for ln in lines if re.match(r"job \w+ step \d+ \(epoch \d+\): loss ", ln)]
    assert len(steps) == 20 and lines[-1].endswith(" done"), r.stdout
    assert (tmp_path / "out" / "readme" / "model.safetensors").is_file()


def test_the_make_job_file_builds_a_job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from fusionp2p.cli.job import _job_from_file

    src = next(b for b in blocks("python") if "def make_job" in b)
    (tmp_path / "my_job.py").write_text(src)
    (tmp_path / "corpus.txt").write_text("the quick brown fox jumps over the lazy dog\n" * 200)
    monkeypatch.chdir(tmp_path)
    spec = _job_from_file("my_job.py")
    assert {"model", "dataset", "config"} <= set(spec) and spec["config"].steps == 200


def test_every_shell_command_parses() -> None:
    cmds = commands()
    fp = [c for c in cmds if c.startswith("fusionp2p ")]
    make = [c for c in cmds if c.startswith("make ")]
    assert {"make demo", "make test"} <= set(make)
    assert len(fp) >= 8, fp
    parser = build_parser()
    for c in fp:
        parser.parse_args(shlex.split(c)[1:])        # SystemExit (argparse's error) fails the test
    for c in make:
        r = subprocess.run([*shlex.split(c)[:1], "-n", *shlex.split(c)[1:]], cwd=ROOT, capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 0, (c, r.stderr)
    docker = [c for c in cmds if c.startswith("docker ")]
    assert docker and all(" fusionp2p node " in c or c.startswith("docker build") for c in docker)
    run = next(c for c in docker if c.startswith("docker run"))
    parser.parse_args(shlex.split(run.split(" fusionp2p ", 1)[1]))   # the image's entrypoint is `fusionp2p`
