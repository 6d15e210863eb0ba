"""Testbed spec files: which hosts, their link rates and compute, where the bootstrap runs.

A spec is JSON (any Python) or TOML (Python >= 3.11); examples live in ``specs/`` next to this
file and the format is documented in docs/testbed.md. Parsing is strict: unknown keys, byte-rate
units and netem-only settings (latency, loss, ...) are ConfigErrors with a one-line message.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fusionp2p.errors import ConfigError
from fusionp2p.testbed.netns import MAX_HOSTS, parse_rate

__all__ = ["HostSpec", "TestbedSpec", "load_spec", "spec_from_dict"]

_HOST_KEYS = {"name", "up", "down", "cpus", "torch_threads", "slowdown", "node_args", "nat"}
_SPEC_KEYS = {"hosts", "bootstrap_host", "bootstrap_port", "description", "nat_inbound"}
_NETEM_KEYS = {"latency", "delay", "rtt", "loss", "jitter"}
_NAME_OK = set("abcdefghijklmnopqrstuvwxyz0123456789-_")


@dataclass(frozen=True, kw_only=True, slots=True)
class HostSpec:
    """One emulated host. Rates are bits per second; None leaves that direction unshaped.

    ``cpus`` caps the CPU time of every process in the host (a cgroup CPU quota, in cores).
    ``torch_threads`` and ``slowdown`` emulate heterogeneous compute too; they reach the processes
    started in the host as environment variables (see :meth:`TestbedHost.env`).
    """

    name: str
    up_bps: int | None = None
    down_bps: int | None = None
    torch_threads: int | None = None
    cpus: float | None = None
    slowdown: float = 1.0
    node_args: tuple[str, ...] = ()
    nat: str = ""   # NAT group: hosts with the same one sit on a private LAN behind one MASQUERADE router

    def __post_init__(self) -> None:
        if self.nat and (len(self.nat) > 32 or not set(self.nat) <= _NAME_OK):
            raise ConfigError(f"host {self.name}: nat {self.nat!r}: use 1-32 characters from a-z, 0-9, '-', '_'")
        if not self.name or len(self.name) > 32 or not set(self.name) <= _NAME_OK:
            raise ConfigError(f"host name {self.name!r}: use 1-32 characters from a-z, 0-9, '-', '_'")
        if self.torch_threads is not None and not 1 <= self.torch_threads <= 256:
            raise ConfigError(f"host {self.name}: torch_threads must be in 1..256")
        if self.cpus is not None and not 0.01 <= self.cpus <= 1024.0:
            raise ConfigError(f"host {self.name}: cpus must be in 0.01..1024 (cores)")
        if not 1.0 <= self.slowdown <= 1000.0:
            raise ConfigError(f"host {self.name}: slowdown must be in 1..1000 (1 = full speed)")


@dataclass(frozen=True, kw_only=True, slots=True)
class TestbedSpec:
    """A whole testbed: its hosts, and where the bootstrap runs (default: the first host)."""

    __test__ = False  # not a pytest test class

    hosts: tuple[HostSpec, ...]
    bootstrap_host: str = ""
    bootstrap_port: int = 4001
    description: str = ""
    # what the NAT routers do with a connection attempt from outside that matches no mapping: "reject"
    # (their own TCP stack answers with a reset) or "drop" (silently, as most home routers' firewalls do;
    # what TCP hole punching needs: docs/networking.md "Hole punching")
    nat_inbound: str = "reject"

    def __post_init__(self) -> None:
        if self.nat_inbound not in ("reject", "drop"):
            raise ConfigError(f"nat_inbound must be 'reject' or 'drop', not {self.nat_inbound!r}")
        if not 1 <= len(self.hosts) <= MAX_HOSTS:
            raise ConfigError(f"a testbed spec needs 1..{MAX_HOSTS} hosts, got {len(self.hosts)}")
        names = [h.name for h in self.hosts]
        if len(set(names)) != len(names):
            raise ConfigError("host names in a testbed spec must be unique")
        if self.bootstrap_host and self.bootstrap_host not in names:
            raise ConfigError(f"bootstrap_host {self.bootstrap_host!r} is not one of the hosts {names}")
        if next(h for h in self.hosts if h.name == self.bootstrap).nat:
            raise ConfigError(f"the bootstrap host {self.bootstrap!r} is behind a NAT; put it on a public host")
        if not 1 <= self.bootstrap_port <= 65535:
            raise ConfigError("bootstrap_port must be in 1..65535")

    @property
    def bootstrap(self) -> str:
        return self.bootstrap_host or self.hosts[0].name


def _opt_rate(where: str, value: Any) -> int | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise ConfigError(f"{where}: a rate is a string such as '100mbit'")
    return parse_rate(value)


def spec_from_dict(doc: Mapping[str, Any]) -> TestbedSpec:
    """Validate a parsed spec document (JSON or TOML) and build the spec. Unknown keys are errors."""
    if not isinstance(doc, Mapping):
        raise ConfigError("a testbed spec is a table/object with a 'hosts' list")
    unknown = set(doc) - _SPEC_KEYS
    if unknown:
        raise ConfigError(f"unknown testbed spec keys {sorted(unknown)}; known: {sorted(_SPEC_KEYS)}")
    raw_hosts = doc.get("hosts")
    if not isinstance(raw_hosts, list) or not raw_hosts:
        raise ConfigError("a testbed spec needs a non-empty 'hosts' list")
    hosts: list[HostSpec] = []
    for i, h in enumerate(raw_hosts):
        if not isinstance(h, Mapping):
            raise ConfigError(f"hosts[{i}] must be a table/object")
        where = f"host {h.get('name', i)!r}"
        netem = set(h) & _NETEM_KEYS
        if netem:
            raise ConfigError(
                f"{where}: {sorted(netem)} not supported: this kernel has no tc netem, the testbed shapes rates only (tbf)"
            )
        bad = set(h) - _HOST_KEYS
        if bad:
            raise ConfigError(f"{where}: unknown keys {sorted(bad)}; known: {sorted(_HOST_KEYS)}")
        threads, slowdown, args = h.get("torch_threads"), h.get("slowdown", 1.0), h.get("node_args", [])
        if threads is not None and (not isinstance(threads, int) or isinstance(threads, bool)):
            raise ConfigError(f"{where}: torch_threads must be an integer")
        cpus = h.get("cpus")
        for key, val in (("slowdown", slowdown), ("cpus", cpus)):
            if val is not None and (not isinstance(val, (int, float)) or isinstance(val, bool)):
                raise ConfigError(f"{where}: {key} must be a number")
        if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
            raise ConfigError(f"{where}: node_args must be a list of strings")
        name = h.get("name")
        if not isinstance(name, str):
            raise ConfigError(f"hosts[{i}] needs a string 'name'")
        nat = h.get("nat", "")
        if not isinstance(nat, str):
            raise ConfigError(f"{where}: nat must be a string (the NAT group's name)")
        hosts.append(
            HostSpec(
                name=name,
                up_bps=_opt_rate(f"{where} up", h.get("up")),
                down_bps=_opt_rate(f"{where} down", h.get("down")),
                torch_threads=threads,
                cpus=None if cpus is None else float(cpus),
                slowdown=float(slowdown),
                node_args=tuple(args),
                nat=nat,
            )
        )
    port = doc.get("bootstrap_port", 4001)
    boot = doc.get("bootstrap_host", "")
    desc = doc.get("description", "")
    inbound = doc.get("nat_inbound", "reject")
    if not isinstance(port, int) or not isinstance(boot, str) or not isinstance(desc, str) or not isinstance(inbound, str):
        raise ConfigError("bootstrap_port is an integer; bootstrap_host, description and nat_inbound are strings")
    return TestbedSpec(hosts=tuple(hosts), bootstrap_host=boot, bootstrap_port=port, description=desc,
                       nat_inbound=inbound)


def load_spec(path: str | os.PathLike[str]) -> TestbedSpec:
    """Read a spec from a ``.json`` or ``.toml`` file; every problem is a one-line ConfigError."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise ConfigError(f"cannot read testbed spec {p}: {e.strerror}") from None
    try:
        if p.suffix == ".toml":
            import tomllib  # Python >= 3.11; JSON specs work on 3.10 too

            doc: Any = tomllib.loads(text)
        else:
            doc = json.loads(text)
    except ImportError:
        raise ConfigError("TOML specs need Python >= 3.11; use the JSON form") from None
    except ValueError as e:  # json.JSONDecodeError and tomllib.TOMLDecodeError are ValueErrors
        raise ConfigError(f"testbed spec {p} does not parse: {e}") from None
    return spec_from_dict(doc)
