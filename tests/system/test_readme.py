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


def _fill(cmd: str, **values: str) -> list[str]:
    """A README command with its placeholders filled in, as argv."""
    argv = []
    for word in shlex.split(cmd):
        for k, v in values.items():
            word = word.replace(k, v)
        argv.append(word)
    return argv


@pytest.mark.slow
@pytest.mark.testbed
@pytest.mark.timeout(600)
def test_the_shell_commands_run_as_written_in_a_private_network(tmp_path: Path) -> None:
    """The README's "run a node" and "train your own model" commands, run for real: a bootstrap and two
    nodes, each in a network namespace of its own (the commands listen on the same port 4001, as on three
    machines), ``status``, the GPU node (here: its one-line error, there is no CUDA), then ``my_job.py``
    submitted, listed, its status read and attached to, its model downloaded. The placeholders are filled
    with the real addresses, ``~`` is a temporary home, and the job's 200 steps are cut to 4. ``make`` and
    ``docker`` lines only parse (test_every_shell_command_parses): they install or need a daemon."""
    from fusionp2p.errors import ConfigError
    from fusionp2p.testbed.emulator import spec_from_dict, up
    from fusionp2p.testbed.netns import check_environment

    try:
        check_environment()
    except ConfigError as exc:
        pytest.skip(str(exc))
    cmds = commands()
    boot_cmd, node_cmd, status_cmd = (next(c for c in cmds if c.startswith(p)) for p in
                                      ("fusionp2p bootstrap", "fusionp2p node --bootstrap", "fusionp2p status"))
    gpu_cmd = next(c for c in cmds if "--device cuda" in c)
    submit, listing, attach, status = (next(c for c in cmds if c.startswith(f"fusionp2p job {w} ")) for w in
                                       ("submit", "list", "attach", "status"))
    src = next(b for b in blocks("python") if "def make_job" in b)
    assert "steps=200" in src
    (tmp_path / "my_job.py").write_text(src.replace("steps=200", "steps=4"))
    (tmp_path / "corpus.txt").write_text((ROOT / "README.md").read_text() * 4)
    env = {"HOME": str(tmp_path / "home"), "OMP_NUM_THREADS": "1"}
    spec = spec_from_dict({"hosts": [{"name": n, "up": "1gbit", "down": "1gbit"} for n in ("boot", "n1", "n2")]})
    with up(spec) as tb:
        def sh(host: str, argv: list[str], timeout: float = 240.0) -> tuple[int, str]:
            return tb.run(host, ["env", "-C", str(tmp_path), *(f"{k}={v}" for k, v in env.items()),
                                 *fusionp2p_argv(argv)], timeout=timeout)

        boot = tb.spawn("boot", ["env", "-C", str(tmp_path), *(f"{k}={v}" for k, v in env.items()),
                                 *fusionp2p_argv(_fill(boot_cmd, **{"~/": env["HOME"] + "/"}))], label="boot-readme")
        addr = boot.read_line(120.0, match=lambda s: s.startswith("/"))
        ip, peer = tb.host("boot").address, addr.rsplit("/p2p/", 1)[1]
        # listening on 0.0.0.0 it prints that address; the reader puts its machine's IP in (BOOTSTRAP_IP)
        assert addr in (f"/ip4/{ip}/tcp/4001/p2p/{peer}", f"/ip4/0.0.0.0/tcp/4001/p2p/{peer}"), addr
        addr = f"/ip4/{ip}/tcp/4001/p2p/{peer}"
        fill = {"/ip4/BOOTSTRAP_IP/tcp/4001/p2p/12D3KooW...": addr, "ADDR": addr}
        nodes = [tb.spawn(h, ["env", *(f"{k}={v}" for k, v in {**env, "HOME": str(tmp_path / h)}.items()),
                              *fusionp2p_argv(_fill(node_cmd, **fill))], label=f"{h}-readme") for h in ("n1", "n2")]
        for n in nodes:
            assert n.read_line(180.0).startswith("/ip4/"), n.err_path.read_text()[-2000:]
        rc, out = sh("boot", _fill(status_cmd, **fill))
        assert rc == 0, out
        rc, out = sh("n1", _fill(gpu_cmd, **fill), timeout=120.0)
        assert rc != 0 and len(out.splitlines()) <= 1, out             # no CUDA here: a one-line error
        rc, out = sh("boot", _fill(submit, **fill), timeout=400.0)
        assert rc == 0 and "job done" in out, out[-3000:]
        job = re.search(r"published job (\w+)", out)
        assert job is not None, out
        rc, out = sh("boot", _fill(listing, **fill))
        assert rc == 0 and job[1][:8] in out, out                     # the table shortens ids
        rc, out = sh("boot", _fill(status, JOB=job[1], **fill))
        assert rc == 0 and "done" in out, out
        rc, out = sh("boot", _fill(attach, JOB=job[1], **fill), timeout=300.0)
        assert rc == 0, out[-3000:]
        assert list((tmp_path / "out").rglob("model.safetensors")), out[-3000:]
        codes = [p.stop(grace=30.0) for p in (*nodes, boot)]
        assert codes == [0, 0, 0], codes


def fusionp2p_argv(argv: list[str]) -> list[str]:
    """``fusionp2p ARGS`` as this interpreter's CLI (the installed script may be another checkout's)."""
    assert argv[0] == "fusionp2p"
    return [sys.executable, "-m", "fusionp2p.cli", *argv[1:]]
