"""The public CLI is pinned: every command and option that the README and docs name still exists
(new options may be added; removing or renaming one must change this test on purpose)."""

from __future__ import annotations

import argparse

import pytest

from fusionp2p.cli.main import build_parser

# command -> options it must accept (and its positional arguments)
PINNED: dict[str, tuple[set[str], list[str]]] = {
    "bootstrap": ({"--announce-addr", "--bootstrap", "--gossip-rate", "--home", "--http", "--listen", "--log-level"}, []),
    "node": ({"--announce-addr", "--bootstrap", "--dead-timeout", "--device", "--gossip-rate", "--heartbeat", "--home",
              "--http", "--listen", "--log-level", "--probe-interval", "--torch-threads", "--data-listen",
               "--data-announce", "--memory", "--disk"}, []),
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


def test_bad_data_plane_addresses_are_one_line_user_errors(capsys: pytest.CaptureFixture[str]) -> None:
    """--data-listen / --data-announce follow the rules of --listen / --announce-addr; a mistake ends
    with one line saying what to write, exit status 2, before anything starts."""
    from fusionp2p.cli.main import main

    boot = "/ip4/127.0.0.1/tcp/1/p2p/12D3KooWLK6ngBJz8BZrs3HnzCXQJdQbadX7z2iqbp7crfMrrrTT"
    for flag, value, says in (("--data-listen", "4002", "expected a TCP multiaddr"),
                              ("--data-listen", "/ip4/0.0.0.0/udp/4002", "expected a TCP multiaddr"),
                              ("--data-announce", "/ip4/0.0.0.0/tcp/4002", "announce the address peers dial"),
                              ("--data-announce", "/ip4/1.2.3.4/tcp/0", "port must be between 1"),
                              ("--data-announce", "/ip4/nope/tcp/4002", "not an IP address"),
                              ("--disk", "ten", "give a size such as 3GiB, 20G")):
        assert main(["node", "--bootstrap", boot, "--home", "/nonexistent/fp2p-test", flag, value]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and flag in err and says in err, err
    with pytest.raises(SystemExit):
        main(["node", "--bootstrap", boot, "--data-listen"])   # argparse: a value is required
