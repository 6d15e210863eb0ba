"""The public CLI is pinned: every command and option that the README and docs name still exists
(new options may be added; removing or renaming one must change this test on purpose)."""

from __future__ import annotations

import argparse

from fusionp2p.cli.main import build_parser

# command -> options it must accept (and its positional arguments)
PINNED: dict[str, tuple[set[str], list[str]]] = {
    "bootstrap": ({"--announce-addr", "--bootstrap", "--gossip-rate", "--home", "--http", "--listen", "--log-level"}, []),
    "node": ({"--announce-addr", "--bootstrap", "--dead-timeout", "--device", "--gossip-rate", "--heartbeat", "--home",
              "--http", "--listen", "--log-level", "--probe-interval", "--torch-threads"}, []),
    "status": ({"--bootstrap", "--json", "--log-level", "--timeout", "--watch"}, []),
    "demo": ({"--log-level", "--nodes", "--out", "--steps"}, []),
    "job": ({"--log-level"}, []),
    "job submit": ({"--bootstrap", "--builtin", "--detach", "--home", "--key", "--out", "--steps"}, ["file"]),
    "job list": ({"--bootstrap", "--json", "--key"}, []),
    "job status": ({"--bootstrap", "--json"}, ["job"]),
    "job attach": ({"--bootstrap", "--key", "--out"}, ["job"]),
    "job download": ({"--bootstrap", "--key", "--out"}, ["job"]),
    "job cancel": ({"--bootstrap", "--key"}, ["job"]),
    "testbed up": ({"--detach", "--no-nodes", "--spec", "--wait-nodes"}, []),
    "testbed down": ({"--name"}, []),
}


def _commands(p: argparse.ArgumentParser, prefix: str = "") -> dict[str, tuple[set[str], list[str]]]:
    out: dict[str, tuple[set[str], list[str]]] = {}
    for a in p._actions:
        if isinstance(a, argparse._SubParsersAction):
            for name, sp in a.choices.items():
                out.update(_commands(sp, f"{prefix} {name}".strip()))
    opts = {o for a in p._actions for o in a.option_strings if o.startswith("--")}
    pos = [a.dest for a in p._actions if not a.option_strings and not isinstance(a, argparse._SubParsersAction)]
    out[prefix] = (opts, pos)
    return out


def test_every_documented_command_and_option_exists() -> None:
    have = _commands(build_parser())
    missing = {cmd: sorted(opts - have.get(cmd, (set(), []))[0]) for cmd, (opts, _) in PINNED.items()
               if cmd not in have or opts - have[cmd][0]}
    assert missing == {}
    assert {cmd: have[cmd][1] for cmd in PINNED} == {cmd: pos for cmd, (_, pos) in PINNED.items()}


def test_log_level_is_accepted_before_and_after_the_job_subcommand() -> None:
    ap = build_parser()
    a = ap.parse_args(["job", "--log-level", "warning", "status", "x", "--bootstrap", "b"])
    b = ap.parse_args(["job", "status", "x", "--bootstrap", "b", "--log-level", "warning"])
    assert a.log_level == b.log_level == "warning"
