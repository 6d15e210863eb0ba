"""The Dockerfile installs what `make setup` installs, and agrees with pyproject.toml.

There is no Docker engine on the development machines, so the image is never built here; instead
the Dockerfile is parsed and checked against the Makefile and pyproject.toml: the same torch pin,
the same install order, the entry point of [project.scripts], the build packages libp2p needs, and a
build context that contains what ``pip install .`` reads.
"""

from __future__ import annotations

import fnmatch
import json
import re
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

tomllib = pytest.importorskip("tomllib")

ROOT = Path(__file__).resolve().parents[2]


def parse_dockerfile(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs; continuation lines joined, comment lines dropped."""
    out: list[tuple[str, str]] = []
    buf = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue  # Docker drops comment lines, also inside a continued instruction
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        full = buf + line
        buf = ""
        word, _, rest = full.partition(" ")
        out.append((word.upper(), " ".join(rest.split())))
    assert not buf, "Dockerfile ends inside a continued instruction"
    return out


def expand(text: str, args: dict[str, str]) -> str:
    return re.sub(r"\$\{?(\w+)\}?", lambda m: args.get(m.group(1), m.group(0)), text).replace('"', "")


@pytest.fixture(scope="module")
def docker() -> list[tuple[str, str]]:
    return parse_dockerfile((ROOT / "Dockerfile").read_text())


@pytest.fixture(scope="module")
def args(docker: list[tuple[str, str]]) -> dict[str, str]:
    out: dict[str, str] = {}
    for ins, rest in docker:
        if ins == "ARG" and "=" in rest:
            k, _, v = rest.partition("=")
            out[k] = v.strip('"')
    return out


@pytest.fixture(scope="module")
def pyproject() -> dict[str, Any]:
    data: dict[str, Any] = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return data


@pytest.fixture(scope="module")
def makefile() -> str:
    return (ROOT / "Makefile").read_text()


def _pip_installs(commands: list[str]) -> list[str]:
    """The argument strings of every ``pip install`` in ``commands``, in order."""
    found: list[str] = []
    for cmd in commands:
        for part in re.split(r"&&|;", cmd):
            m = re.search(r"\bpip install\s+(.*)$", part.strip())
            if m:
                found.append(m.group(1).strip())
    return found


def _requirement(pyproject: dict[str, Any], name: str) -> Requirement:
    reqs = [Requirement(r) for r in pyproject["project"]["dependencies"]]
    matches = [r for r in reqs if r.name == name]
    assert len(matches) == 1, f"{name} must appear once in [project.dependencies]"
    return matches[0]


def test_parser_joins_continuations_and_drops_comments() -> None:
    text = "FROM a\n# c\nRUN x \\\n  # inner comment\n  && y\nCMD [\"z\"]\n"
    assert parse_dockerfile(text) == [("FROM", "a"), ("RUN", "x && y"), ("CMD", '["z"]')]


def test_base_image_is_python_slim_within_requires_python(docker: list[tuple[str, str]], pyproject: dict[str, Any]) -> None:
    froms = [rest for ins, rest in docker if ins == "FROM"]
    assert len(froms) == 1
    m = re.fullmatch(r"python:(\d+\.\d+)-slim(?:-\w+)?", froms[0])
    assert m, f"expected a Debian python:X.Y-slim base, got {froms[0]}"
    assert Version(m.group(1)) in SpecifierSet(pyproject["project"]["requires-python"])


def test_torch_pin_matches_makefile_and_pyproject(args: dict[str, str], makefile: str, pyproject: dict[str, Any]) -> None:
    m = re.search(r"^TORCH_SPEC\s*:?=\s*(\S+)\s*$", makefile, re.M)
    assert m, "Makefile must define TORCH_SPEC"
    assert args["TORCH_SPEC"] == m.group(1)
    pinned = Requirement(args["TORCH_SPEC"])
    assert pinned.name == "torch"
    (spec,) = pinned.specifier
    assert spec.operator == "=="
    # The pinned torch must satisfy the project's own torch requirement.
    assert Version(spec.version) in _requirement(pyproject, "torch").specifier
    assert "cpu" in args["TORCH_INDEX_URL"], "the image installs CPU-only torch"


def test_install_steps_mirror_make_setup(docker: list[tuple[str, str]], args: dict[str, str], makefile: str) -> None:
    runs = [expand(rest, args) for ins, rest in docker if ins == "RUN"]
    steps = _pip_installs(runs)
    # Same order as `make setup`: pip itself, then torch alone, then the project.
    assert len(steps) == 3, steps
    assert steps[0] == "--upgrade pip"
    assert steps[1] == f"--index-url {args['TORCH_INDEX_URL']} {args['TORCH_SPEC']}"
    assert steps[2] == "."
    recipe = makefile.split("$(STAMP): pyproject.toml", 1)[1].split("\n\n", 1)[0]
    make_steps = [re.sub(r"\$\(PIP_FLAGS\)\s*", "", s) for s in _pip_installs(recipe.splitlines())]
    assert make_steps == ["--upgrade pip", "$(TORCH_FROM) $(TORCH_SPEC)", "-e '.[dev]'"]   # TORCH_INDEX: the build


def test_libp2p_is_pinned_exactly(pyproject: dict[str, Any]) -> None:
    assert str(_requirement(pyproject, "libp2p").specifier) == "==0.8.1"


def test_entrypoint_is_the_console_script_and_default_command_is_node(docker: list[tuple[str, str]], pyproject: dict[str, Any]) -> None:
    entry = [json.loads(rest) for ins, rest in docker if ins == "ENTRYPOINT"]
    cmd = [json.loads(rest) for ins, rest in docker if ins == "CMD"]
    assert len(entry) == 1
    assert len(cmd) == 1
    assert entry[0] == ["fusionp2p"]
    assert entry[0][0] in pyproject["project"]["scripts"]
    assert cmd[0] == ["node"]


def test_build_packages_for_libp2p(docker: list[tuple[str, str]]) -> None:
    apt = " ".join(rest for ins, rest in docker if ins == "RUN" and "apt-get install" in rest)
    packages = set(apt.split())
    assert {"gcc", "libgmp-dev", "libc6-dev"} <= packages
    assert "rm -rf /var/lib/apt/lists/*" in apt


def test_runs_unprivileged_with_a_home_volume_and_the_p2p_port(docker: list[tuple[str, str]]) -> None:
    users = [rest for ins, rest in docker if ins == "USER"]
    assert users
    assert users[-1] not in ("root", "0")
    useradd = next(rest for ins, rest in docker if ins == "RUN" and "useradd" in rest)
    home = re.search(r"--home-dir\s+(\S+)", useradd)
    assert home
    assert re.search(rf"\b{re.escape(users[-1])}\b", useradd)
    volumes = [v for ins, rest in docker if ins == "VOLUME" for v in json.loads(rest)]
    assert home.group(1) in volumes
    assert [rest for ins, rest in docker if ins == "EXPOSE"] == ["4001 4002 9100"]   # libp2p; data plane; --http


def _docker_runs(text: str) -> list[list[str]]:
    """The argument lists of every ``docker run`` command in a Markdown or Dockerfile text (continuation
    lines joined; a Dockerfile's ``#`` comment prefixes dropped)."""
    lines = [re.sub(r"^#\s?", "", ln).strip() for ln in text.splitlines()]
    out: list[list[str]] = []
    buf = ""
    for line in lines:
        if buf or line.startswith("docker run"):
            if line.endswith("\\"):
                buf += line[:-1] + " "
                continue
            out.append((buf + line).split())
            buf = ""
    return out


@pytest.mark.parametrize("doc", ["README.md", "docs/docker.md", "Dockerfile"])
def test_documented_docker_run_publishes_the_exposed_ports_the_cli_listens_on(doc: str, docker: list[tuple[str, str]]) -> None:
    """Every documented ``docker run ... node`` publishes the libp2p and data-plane ports it pins, those
    ports are EXPOSEd, the announced ones match, and the CLI parses the command line."""
    from fusionp2p.cli.main import build_parser
    from fusionp2p.jobs.node import NodeJobConfig
    from fusionp2p.net.addrs import tcp_endpoint

    exposed = {int(p) for ins, rest in docker if ins == "EXPOSE" for p in rest.split()}
    text = re.sub(r"\b(MY_)?PUBLIC_IP\b", "203.0.113.7", (ROOT / doc).read_text())   # the docs' placeholders
    runs = [r for r in _docker_runs(text) if "node" in r]
    assert runs, f"{doc} documents no `docker run ... node`"
    for argv in runs:
        published = {int(argv[i + 1].split(":")[1]) for i, a in enumerate(argv) if a == "-p"}
        cli = argv[argv.index("fusionp2p") + 1:]          # the image's entry point is `fusionp2p`
        args = build_parser().parse_args(cli)              # exits (SystemExit) on an unknown option
        assert args.cmd == "node"
        assert args.data_listen and args.data_announce, f"{doc}: pin and announce the data plane"
        p2p = {tcp_endpoint(a, "--listen")[1] for a in args.listen}
        data = tcp_endpoint(args.data_listen, "--data-listen")[1]
        assert p2p | {data} <= published, f"{doc}: publish the libp2p and data-plane ports with -p"
        assert published <= exposed, f"{doc}: every published port is EXPOSEd in the Dockerfile"
        assert {tcp_endpoint(a, "--announce-addr", announce=True)[1] for a in args.announce_addr} == p2p
        assert tcp_endpoint(args.data_announce, "--data-announce", announce=True)[1] == data
        NodeJobConfig(data_listen=args.data_listen, data_announce=args.data_announce)   # what the node checks


def _ignored(path: str, patterns: list[str]) -> bool:
    return any(fnmatch.fnmatch(path, p) or fnmatch.fnmatch(path.split("/")[0], p) for p in patterns)


def test_build_context_holds_everything_pip_install_reads(docker: list[tuple[str, str]], pyproject: dict[str, Any]) -> None:
    patterns = [ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    assert ".venv" in patterns
    assert ".git" in patterns
    sources = [src for ins, rest in docker if ins == "COPY" for src in rest.split()[:-1]]
    for src in sources:
        assert (ROOT / src).exists(), f"COPY {src}: no such file"
        assert not _ignored(src, patterns), f"COPY {src} is excluded by .dockerignore"
    assert pyproject["project"]["readme"] in sources
    assert "pyproject.toml" in sources
    for include in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]:
        top = include.rstrip("*")
        assert top in sources, f"package {top} is installed by pyproject but not copied into the image"
