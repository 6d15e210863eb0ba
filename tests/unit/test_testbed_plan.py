"""The pure parts of the testbed: rates, tbf parameters, the namespace plan, specs, the rate meter.

Plus the process helper's deadlines, with ordinary local processes (no namespaces, no root).
"""

from __future__ import annotations

import ipaddress
import json
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fusionp2p.errors import ConfigError
from fusionp2p.testbed import netns
from fusionp2p.testbed.emulator import HostSpec, TestbedSpec, load_spec, spec_from_dict
from fusionp2p.testbed.netns import (
    TestbedError,
    exec_argv,
    format_rate,
    make_layout,
    parse_rate,
    plan_commands,
    run_of,
    spawn_process,
    tbf_params,
)
from fusionp2p.testbed.tcpprobe import RateMeter

SPECS = Path(netns.__file__).parent / "specs"
RUN = "fp2p-0a1b2c"


@pytest.mark.parametrize(
    ("text", "bps"),
    [
        ("10mbit", 10_000_000),
        ("1gbit", 1_000_000_000),
        ("10GBit", 10_000_000_000),
        ("1.5gbit", 1_500_000_000),
        ("500kbit", 500_000),
        ("8000000bit", 8_000_000),
        ("8000000", 8_000_000),
        (" 100mbit ", 100_000_000),
    ],
)
def test_parse_rate(text: str, bps: int) -> None:
    assert parse_rate(text) == bps


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("100mbps", "bytes per second"),
        ("100MBps", "bytes per second"),
        ("fast", "expected a number"),
        ("10 furlongs", "unknown unit"),
        ("1kbit", "between"),
        ("200gbit", "between"),
        ("-5mbit", "expected a number"),
    ],
)
def test_parse_rate_rejects(text: str, why: str) -> None:
    with pytest.raises(ConfigError, match=why):
        parse_rate(text)


@settings(max_examples=200, deadline=None)
@given(st.integers(min_value=netns.MIN_RATE_BPS, max_value=netns.MAX_RATE_BPS))
def test_format_rate_round_trips(bps: int) -> None:
    assert parse_rate(format_rate(bps)) == bps


def test_format_rate_picks_the_largest_exact_unit() -> None:
    assert [format_rate(r) for r in (10**9, 20 * 10**6, 1500, 10**10)] == ["1gbit", "20mbit", "1500bit", "10gbit"]


@settings(max_examples=100, deadline=None)
@given(st.integers(min_value=netns.MIN_RATE_BPS, max_value=netns.MAX_RATE_BPS))
def test_tbf_burst_covers_a_gso_packet_and_two_ms_of_rate(bps: int) -> None:
    p = tbf_params(bps)
    assert p.burst_bytes >= 64 * 1024  # a whole 64 KiB GSO super-packet fits
    assert p.burst_bytes >= bps / 8 * 0.002 - 1
    assert p.argv()[:3] == ["tbf", "rate", f"{bps}bit"]


def test_tbf_params_at_the_documented_rates() -> None:
    assert tbf_params(10 * 10**6).burst_bytes == 65536
    assert tbf_params(10**9).burst_bytes == 250_000
    assert tbf_params(10 * 10**9).burst_bytes == 2_500_000
    assert tbf_params(10**9).argv() == ["tbf", "rate", "1000000000bit", "burst", "250000", "latency", "50ms"]


def test_layout_names_and_addresses() -> None:
    lay = make_layout(RUN, 7, [(10**8, 10**8), (None, 2 * 10**7), (None, None)])
    assert lay.bridge_ns == f"{RUN}-br"
    assert [h.namespace for h in lay.hosts] == [f"{RUN}-h0", f"{RUN}-h1", f"{RUN}-h2"]
    assert [h.address for h in lay.hosts] == ["10.77.7.10", "10.77.7.11", "10.77.7.12"]
    assert lay.namespaces[-1] == lay.bridge_ns  # hosts are torn down before the bridge
    assert all(run_of(ns) == RUN for ns in lay.namespaces)


@settings(max_examples=30, deadline=None)
@given(
    octet=st.integers(0, 255),
    rates=st.lists(
        st.tuples(st.none() | st.integers(netns.MIN_RATE_BPS, 10**10), st.none() | st.integers(netns.MIN_RATE_BPS, 10**10)),
        min_size=1,
        max_size=12,
    ),
)
def test_plan_only_touches_our_namespaces(octet: int, rates: list[tuple[int | None, int | None]]) -> None:
    lay = make_layout(RUN, octet, rates)
    ours = set(lay.namespaces)
    cmds = plan_commands(lay)
    added = [c[3] for c in cmds if c[:3] == ["ip", "netns", "add"]]
    assert sorted(added) == sorted(ours)
    for c in cmds:
        if c[:3] == ["ip", "netns", "add"]:
            continue
        # Every other command runs inside one of our namespaces: nothing in the root namespace.
        assert c[0] in ("ip", "tc")
        assert c[1] == "-n"
        assert c[2] in ours
        if "netns" in c[3:]:  # the veth peer is moved straight into a host namespace
            assert c[c.index("netns", 3) + 1] in ours
    net = ipaddress.ip_network(f"10.77.{octet}.0/24")
    addrs = [ipaddress.ip_interface(c[5]) for c in cmds if c[3:5] == ["addr", "add"]]
    assert len(addrs) == len(set(addrs)) == len(rates)
    assert all(a.network == net for a in addrs)
    shaped_up = [c[2] for c in cmds if c[0] == "tc" and c[2] != lay.bridge_ns]
    shaped_down = [c[6] for c in cmds if c[0] == "tc" and c[2] == lay.bridge_ns]
    assert shaped_up == [h.namespace for h in lay.hosts if h.up_bps is not None]
    assert shaped_down == [f"p{h.index}" for h in lay.hosts if h.down_bps is not None]


def test_layout_rejects_bad_input() -> None:
    with pytest.raises(ConfigError, match="testbed name"):
        make_layout("other-0a1b2c", 1, [(None, None)])
    with pytest.raises(ConfigError, match="octet"):
        make_layout(RUN, 256, [(None, None)])
    with pytest.raises(ConfigError, match="hosts"):
        make_layout(RUN, 1, [])


def test_run_of_recognises_only_our_namespaces() -> None:
    assert run_of(f"{RUN}-h12") == RUN
    assert run_of(f"{RUN}-br") == RUN
    for other in ("fp2p-0a1b2c", "fp2p-xyz123-h0", "docker-h0", f"{RUN}-h0x", "fp2p-0a1b2c-eth0"):
        assert run_of(other) is None


def test_delete_refuses_foreign_namespaces() -> None:
    with pytest.raises(ConfigError, match="not a testbed namespace"):
        netns.delete_namespace("somebody-elses-ns")


def test_exec_argv() -> None:
    assert exec_argv(f"{RUN}-h0", ["python", "-V"]) == ["ip", "netns", "exec", f"{RUN}-h0", "python", "-V"]
    with pytest.raises(ConfigError):
        exec_argv(f"{RUN}-h0", [])


def test_cpu_cap_helpers() -> None:
    assert netns.cfs_quota_us(0.25) == 25_000
    assert netns.cfs_quota_us(2) == 200_000
    assert netns.cfs_quota_us(0.001) == 1000  # the kernel's minimum quota
    argv = netns.in_cgroup_argv(Path("/sys/fs/cgroup/cpu/x/cgroup.procs"), ["ip", "netns", "exec", "n", "python"])
    assert argv[:3] == ["sh", "-c", 'echo $$ > "$0" && exec "$@"']
    assert argv[3:] == ["/sys/fs/cgroup/cpu/x/cgroup.procs", "ip", "netns", "exec", "n", "python"]
    with pytest.raises(ConfigError, match="not a testbed namespace"):
        netns.make_cpu_cgroup("../../etc", 1.0)


def test_in_cgroup_argv_runs_the_command_with_the_same_pid(tmp_path: Path) -> None:
    procs = tmp_path / "cgroup.procs"  # a plain file stands in for the cgroup
    code = "import os; print(os.getpid(), flush=True)"
    p = spawn_process(netns.in_cgroup_argv(procs, [sys.executable, "-c", code]), label="cg", env={}, logdir=tmp_path, pipe_stdout=True)
    assert int(p.read_line(20.0)) == p.pid
    assert p.wait(20.0) == 0
    assert procs.read_text().strip() == str(p.pid)


def test_check_environment_without_root_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("os.geteuid", lambda: 1000)
    with pytest.raises(ConfigError) as ei:
        netns.check_environment()
    assert str(ei.value).startswith("testbed needs root and iproute2")
    assert "\n" not in str(ei.value)


def test_check_environment_without_ip(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("os.geteuid", lambda: 0)
    monkeypatch.setattr("shutil.which", lambda tool: None)
    with pytest.raises(ConfigError, match="'ip' not found"):
        netns.check_environment()


# ---------------------------------------------------------------- specs


def _doc(**host: object) -> dict[str, object]:
    return {"hosts": [{"name": "a", "up": "10mbit", "down": "20mbit", **host}]}


def test_spec_from_dict() -> None:
    spec = spec_from_dict(
        {"bootstrap_host": "b", "hosts": [{"name": "a", "up": "1gbit"}, {"name": "b", "down": "8mbit", "cpus": 0.5, "torch_threads": 2, "slowdown": 3, "node_args": ["--device", "cpu"]}]}
    )
    assert spec.bootstrap == "b"
    assert spec.hosts == (
        HostSpec(name="a", up_bps=10**9),
        HostSpec(name="b", down_bps=8 * 10**6, cpus=0.5, torch_threads=2, slowdown=3.0, node_args=("--device", "cpu")),
    )
    assert TestbedSpec(hosts=spec.hosts).bootstrap == "a"


@pytest.mark.parametrize(
    ("doc", "why"),
    [
        (_doc(latency="50ms"), "no tc netem"),
        (_doc(loss=0.01), "no tc netem"),
        (_doc(colour="red"), "unknown keys"),
        (_doc(up="100mbps"), "bytes per second"),
        (_doc(up=100), "a rate is a string"),
        (_doc(name="Bad Name"), "host name"),
        (_doc(torch_threads=0), "torch_threads"),
        (_doc(torch_threads="2"), "torch_threads"),
        (_doc(slowdown=0.5), "slowdown"),
        (_doc(cpus=0), "cpus"),
        (_doc(cpus="1"), "cpus must be a number"),
        (_doc(node_args="--x"), "node_args"),
        ({"hosts": []}, "non-empty 'hosts'"),
        ({"hosts": [{"name": "a"}, {"name": "a"}]}, "unique"),
        ({"hosts": [{"name": "a"}], "bootstrap_host": "z"}, "bootstrap_host"),
        ({"hosts": [{"name": "a"}], "subnet": "10.0.0.0/8"}, "unknown testbed spec keys"),
        ({"hosts": [{"name": "a"}], "bootstrap_port": 0}, "bootstrap_port"),
        ([1, 2], "a testbed spec is"),
    ],
)
def test_bad_specs_are_config_errors(doc: object, why: str) -> None:
    with pytest.raises(ConfigError, match=why):
        spec_from_dict(doc)  # type: ignore[arg-type]


def test_shipped_specs_load() -> None:
    files = sorted(SPECS.glob("*.json")) + sorted(SPECS.glob("*.toml"))
    assert len(files) >= 4
    for f in files:
        spec = load_spec(f)
        assert all(h.up_bps is not None and h.down_bps is not None for h in spec.hosts), f
    geo = load_spec(SPECS / "geo8.json")
    rates = [r for h in geo.hosts for r in (h.up_bps, h.down_bps) if r is not None]
    assert min(rates) == 8 * 10**6  # FusionLLM's range: 8 Mbit/s ...
    assert max(rates) == 10 * 10**9  # ... to 10 Gbit/s
    toml, js = load_spec(SPECS / "wan6.toml"), load_spec(SPECS / "wan6.json")
    assert [(h.name, h.up_bps, h.down_bps) for h in toml.hosts] == [(h.name, h.up_bps, h.down_bps) for h in js.hosts]


def test_load_spec_errors_are_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{ not json")
    for path, why in ((bad, "does not parse"), (tmp_path / "missing.json", "cannot read")):
        with pytest.raises(ConfigError, match=why) as ei:
            load_spec(path)
        assert "\n" not in str(ei.value)
    good = tmp_path / "ok.json"
    good.write_text(json.dumps(_doc()))
    assert load_spec(good).hosts[0].down_bps == 20 * 10**6


# ---------------------------------------------------------------- the probe's rate meter


def test_rate_meter_skips_the_warmup() -> None:
    m = RateMeter(warmup=0.5)
    m.add(10.0, 1_000_000)  # a tbf burst arriving at once
    for i in range(1, 21):
        m.add(10.0 + 0.1 * i, 125_000)  # then 10 Mbit/s
    r = m.result()
    assert r.total_bytes == 1_000_000 + 20 * 125_000
    assert r.steady_seconds == pytest.approx(1.5)
    assert r.bits_per_s == pytest.approx(10e6)


@settings(max_examples=50, deadline=None)
@given(rate=st.floats(1e3, 1e10), dt=st.floats(1e-4, 0.1), n=st.integers(5, 200))
def test_rate_meter_recovers_a_constant_rate(rate: float, dt: float, n: int) -> None:
    m = RateMeter(warmup=0.0)
    chunk = max(1, round(rate / 8 * dt))
    for i in range(n):
        m.add(i * dt, chunk)
    assert m.result().bits_per_s == pytest.approx(8 * chunk / dt, rel=1e-6)


def test_rate_meter_without_data() -> None:
    assert RateMeter(warmup=0.3).result().bits_per_s == 0.0
    with pytest.raises(ValueError):
        RateMeter(warmup=-1.0)


# ---------------------------------------------------------------- process helper deadlines


def test_proc_read_line_skips_non_matching_lines_and_records_output(tmp_path: Path) -> None:
    code = "print('log: starting'); print('/ip4/10.77.1.10/tcp/4001/p2p/X', flush=True)"
    p = spawn_process([sys.executable, "-c", code], label="boot", env={}, logdir=tmp_path, pipe_stdout=True)
    assert p.read_line(20.0, match=lambda s: s.startswith("/")) == "/ip4/10.77.1.10/tcp/4001/p2p/X"
    assert p.wait(20.0) == 0
    assert p.drain_stdout().splitlines() == ["log: starting", "/ip4/10.77.1.10/tcp/4001/p2p/X"]
    assert (tmp_path / "boot.out").read_text().splitlines()[0] == "log: starting"


def test_proc_read_line_reports_an_early_exit(tmp_path: Path) -> None:
    code = "import sys; print('boom', file=sys.stderr); sys.exit(3)"
    p = spawn_process([sys.executable, "-c", code], label="bad", env={}, logdir=tmp_path, pipe_stdout=True)
    with pytest.raises(TestbedError, match="exited with status 3"):
        p.read_line(20.0)
    assert (tmp_path / "bad.err").read_text().strip() == "boom"


def test_proc_read_line_deadline_and_stop(tmp_path: Path) -> None:
    code = "import time; time.sleep(600)"
    for piped in (True, False):
        p = spawn_process([sys.executable, "-c", code], label=f"mute{piped}", env={}, logdir=tmp_path, pipe_stdout=piped)
        with pytest.raises(TestbedError, match=r"no output line within 0\.3 s"):
            p.read_line(0.3)
        assert p.stop(grace=5.0) == -15  # SIGTERM ended it


def test_proc_detached_output_is_followed_in_the_file(tmp_path: Path) -> None:
    code = "import time; print('first', flush=True); print('second', flush=True); time.sleep(600)"
    p = spawn_process([sys.executable, "-c", code], label="det", env={}, logdir=tmp_path, pipe_stdout=False)
    try:
        assert p.read_line(20.0) == "first"
        assert p.read_line(20.0) == "second"
    finally:
        p.stop(grace=5.0)


def test_nat_layout_puts_grouped_hosts_behind_one_masquerade_router() -> None:
    """Hosts of a NAT group get private addresses on their router's LAN and a default route through it;
    the router has a WAN leg on the public bridge and translates (MASQUERADE) what leaves it; public
    hosts are unchanged and get no route into the LAN."""
    from fusionp2p.testbed.netns import make_layout, plan_commands

    lay = make_layout("fp2p-abcdef", 7, [(None, None), (10**8, None), (None, 2 * 10**7)], ["", "home", "home"])
    assert [h.address for h in lay.hosts] == ["10.77.7.10", "192.168.100.11", "192.168.100.12"]
    assert [h.router for h in lay.hosts] == ["", "fp2p-abcdef-r0", "fp2p-abcdef-r0"]
    (r,) = lay.routers
    assert r.wan_address == "10.77.7.250"
    assert lay.namespaces[-2:] == ("fp2p-abcdef-r0", "fp2p-abcdef-br")
    cmds = [" ".join(c) for c in plan_commands(lay)]
    assert "ip netns exec fp2p-abcdef-r0 iptables -t nat -A POSTROUTING -s 192.168.100.0/24 -o wan0 -j MASQUERADE" in cmds
    assert "ip netns exec fp2p-abcdef-r0 sysctl -q -w net.ipv4.ip_forward=1" in cmds
    # INVALID packets are dropped, never answered by the router's own stack with a RST
    assert "ip netns exec fp2p-abcdef-r0 iptables -A INPUT -m conntrack --ctstate INVALID -j DROP" in cmds
    assert "ip -n fp2p-abcdef-h1 route add default via 192.168.100.1" in cmds
    assert not any("route add" in c and "fp2p-abcdef-h0" in c for c in cmds)
    assert "ip -n fp2p-abcdef-r0 link add p1 type veth peer name eth0 netns fp2p-abcdef-h1" in cmds
    # the NAT'd host's downlink is shaped on its port in the router, the uplink on its own eth0
    assert any(c.startswith("tc -n fp2p-abcdef-r0 qdisc replace dev p2 root tbf rate 20000000bit") for c in cmds)
    assert any(c.startswith("tc -n fp2p-abcdef-h1 qdisc replace dev eth0 root tbf rate 100000000bit") for c in cmds)
    assert not any("iptables" in c for c in [" ".join(c) for c in plan_commands(make_layout("fp2p-abcdef", 7, [(None, None)]))])
    # routers reset unsolicited connection attempts unless the spec asks them to drop them (hole punching)
    drop = "ip netns exec fp2p-abcdef-r0 iptables -A INPUT -i wan0 -p tcp --syn -j DROP"
    assert drop not in cmds
    punch = make_layout("fp2p-abcdef", 7, [(None, None), (None, None)], ["", "home"], drop_inbound=True)
    assert drop in [" ".join(c) for c in plan_commands(punch)]


def test_nat_spec_checks() -> None:
    from fusionp2p.errors import ConfigError
    from fusionp2p.testbed.spec import spec_from_dict

    spec = spec_from_dict({"hosts": [{"name": "b"}, {"name": "h", "nat": "home"}]})
    assert [h.nat for h in spec.hosts] == ["", "home"]
    with pytest.raises(ConfigError, match="behind a NAT"):
        spec_from_dict({"hosts": [{"name": "b", "nat": "home"}, {"name": "h"}]})
    with pytest.raises(ConfigError, match="nat"):
        spec_from_dict({"hosts": [{"name": "b"}, {"name": "h", "nat": "Home!"}]})
    assert spec.nat_inbound == "reject"
    assert spec_from_dict({"hosts": [{"name": "b"}], "nat_inbound": "drop"}).nat_inbound == "drop"
    with pytest.raises(ConfigError, match="nat_inbound"):
        spec_from_dict({"hosts": [{"name": "b"}], "nat_inbound": "accept"})
