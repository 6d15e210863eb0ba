"""A hostile peer against the network surfaces of issue 43, as a process on a host of the testbed:
``python -m tests.system.net_attacker --bootstrap ADDR --ip IP --duration S --report FILE`` (from the
repository root). It lives beside the tests, not in ``fusionp2p/testing``: it speaks the relay's and DCUtR's
protobufs itself, and only ``net/`` may import libp2p in the package.

tests/system/test_hostile_nat.py runs it on a public host beside a swarm whose bootstrap relays for nodes
behind NATs, and whose nodes hole-punch (``--hole-punch``). With one member identity and ``--sybils``
throwaway ones, all on ``IP``, until ``--duration`` is up it does what the review of issue 43 found a
stranger can do (docs/security.md):

* **dcutr** (finding 1): over a circuit to a NAT'd member (the *victim*), hole-punching sessions whose
  ``CONNECT`` lists junk, 16 ports it counts on ``IP`` and 300 more on ``IP`` that the test counts
  (an iptables rule), then ``SYNC``; again every few seconds. A node that dials what it is told would
  connect to hundreds of them, three rounds each;
* **relay** (findings 2, 4, 5): every sybil reserves a slot on the bootstrap's relay, then all of them at
  once open circuits to the victim (raw ``CONNECT``s on the hop protocol), hold them a few seconds and
  drop them, again and again: the per-IP reservation and circuit limits must hold, and no honest
  circuit to the victim may end with theirs;
* **reach** (finding 3): every sybil asks the bootstrap's dial-back service to check ports on ``IP``
  that drop SYNs (the test's iptables rule), a new request every ``min_interval``, each held for the
  service's whole request timeout: honest nodes checked meanwhile must still learn their reach;
* **addresses** (finding 7): the member's signed record names 16 addresses on ``IP`` (counting
  listeners) and says ``reach=public``, so that every node that dials it would dial all 16.

It prints ``attacking`` once the victim is known, and writes what it did and what it saw (connections
each set of listeners took, the relay's and the reach service's answers) to ``--report`` as JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import logging
import signal
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import multiaddr
import trio
from libp2p.peer.id import ID
from libp2p.relay.circuit_v2.dcutr import PROTOCOL_ID as DCUTR
from libp2p.relay.circuit_v2.dcutr import read_dcutr_msg
from libp2p.relay.circuit_v2.pb.circuit_pb2 import HopMessage
from libp2p.relay.circuit_v2.pb.circuit_pb2 import PeerId as CircuitPeerId
from libp2p.relay.circuit_v2.pb.dcutr_pb2 import HolePunch
from libp2p.relay.circuit_v2.protocol_buffer import StatusCode
from libp2p.relay.circuit_v2.utils import read_delimited_msg, write_delimited_msg

from fusionp2p.errors import FusionError, PeerUnavailable, RemoteProtocolError
from fusionp2p.net.identity import Identity
from fusionp2p.net.libp2p_host import Libp2pConfig, Libp2pTransport, open_libp2p_transport
from fusionp2p.net.relay import HOP
from fusionp2p.swarm.node import SwarmConfig, SwarmNode
from fusionp2p.swarm.probe import ProbeConfig
from fusionp2p.swarm.reach import _request
from fusionp2p.types import DeviceProfile
from fusionp2p.wire import reach as wr
from fusionp2p.wire.records import REACH_PRIVATE, REACH_PUBLIC, NodeRecord

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import BaseExceptionGroup

log = logging.getLogger("net_attacker")
PROFILE = DeviceProfile(device="cpu", kind="cpu", name="attacker", flops_fp32=1e9, flops_bf16=0.0, memory_bytes=1 << 30)
CLOSED_PORTS = range(1000, 1300)   # on IP, listed in the DCUtR CONNECTs; the test counts SYNs to them
DROP_PORTS = range(2000, 2004)     # on IP, named in the reach checks; the test drops SYNs to them (4 dials of
                                   # 3 s: a check holds its slot 12 s, and is answered within the service's 15 s)


class _Liar(SwarmNode):
    """A member whose record says it is public whatever the dial-back found (its addresses are the
    counting listeners: only they are in its record)."""

    def _record(self, leaving: bool = False, gone: tuple[str, ...] = ()) -> NodeRecord:
        return dataclasses.replace(super()._record(leaving, gone), reach=REACH_PUBLIC)


class Counting:
    """TCP listeners on *ip* that count the connections each one takes, then close them."""

    def __init__(self) -> None:
        self.ports: list[int] = []
        self.hits: Counter[int] = Counter()

    async def open(self, nursery: trio.Nursery, ip: str, n: int) -> None:
        for _ in range(n):
            listeners = await trio.open_tcp_listeners(0, host=ip)
            port = listeners[0].socket.getsockname()[1]
            self.ports.append(port)
            await nursery.start(trio.serve_listeners, functools.partial(self._take, port), listeners)

    async def _take(self, port: int, stream: trio.SocketStream) -> None:
        self.hits[port] += 1
        await trio.aclose_forcefully(stream)

    def report(self) -> dict[str, Any]:
        return {"listened": len(self.ports), "ports_hit": len(self.hits), "connects": sum(self.hits.values())}


class NetAttacker:
    def __init__(self, args: argparse.Namespace, member: Libp2pTransport, swarm: SwarmNode, sybils: list[Libp2pTransport],
                 punch_ports: Counting, record_ports: Counting) -> None:
        self.args = args
        self.ip: str = args.ip
        self.boot = args.bootstrap.rsplit("/p2p/", 1)[1]
        self.member = member
        self.swarm = swarm
        self.sybils = sybils
        self.punch_ports = punch_ports
        self.record_ports = record_ports
        self.victim = ""
        self.victim_circuit = ""
        self.first_circuit = trio.Event()   # the member's own circuit comes first (the sybils fill the per-IP quota)
        self.counts: Counter[str] = Counter()
        self.circuits_held = 0
        self.circuits_held_max = 0
        self.checks_served_now = 0
        self.checks_served_max = 0

    def find_victim(self) -> bool:
        """A NAT'd member announcing a circuit through the bootstrap (the lowest peer id of those)."""
        for peer, rec in sorted(self.swarm.view.records.items()):
            circuits = [a for a in rec.addrs if "/p2p-circuit" in a and f"/p2p/{self.boot}/" in a]
            if peer != self.member.peer_id and rec.role == "node" and rec.reach == REACH_PRIVATE and circuits:
                self.victim, self.victim_circuit = peer, f"{circuits[0]}/p2p/{peer}"
                return True
        return False

    # ----------------------------------------------------------------------------------------- dcutr
    def _connect_msg(self) -> HolePunch:
        junk = ["/ip4/169.254.169.254/tcp/80", "/ip4/127.0.0.1/tcp/22", "/dns4/victim.example/tcp/80",
                f"/ip4/{self.ip}/udp/4001/quic-v1", "/ip4/0.0.0.0/tcp/22"]
        addrs = [*junk, *(f"/ip4/{self.ip}/tcp/{p}" for p in self.punch_ports.ports),
                 *(f"/ip4/{self.ip}/tcp/{p}" for p in CLOSED_PORTS)]
        return HolePunch(type=HolePunch.CONNECT, ObsAddrs=[multiaddr.Multiaddr(a).to_bytes() for a in addrs])

    async def dcutr(self) -> None:
        msg = self._connect_msg()
        self.counts["dcutr_addrs_per_connect"] = len(msg.ObsAddrs)
        while True:
            try:
                if not self.member.is_relayed(self.victim):
                    with trio.fail_after(30):
                        await self.member.connect(self.victim_circuit)
                if self.member.is_relayed(self.victim):
                    await self._punch_session(msg)
                else:
                    self.counts["dcutr_not_relayed"] += 1
            except (FusionError, trio.TooSlowError, OSError) as exc:
                self.counts["dcutr_no_circuit"] += 1
                log.debug("circuit to the victim: %s", exc)
            self.first_circuit.set()
            await trio.sleep(3)

    async def _punch_session(self, msg: HolePunch) -> None:
        try:
            with trio.fail_after(15):
                s = await self.member.host.new_stream(ID.from_base58(self.victim), [DCUTR])
                await write_delimited_msg(s, msg)
                reply = await read_dcutr_msg(s, HolePunch)
                await write_delimited_msg(s, HolePunch(type=HolePunch.SYNC))
            self.counts["dcutr_sessions_answered" if reply.type == HolePunch.CONNECT else "dcutr_sessions_odd"] += 1
            await trio.sleep(2)   # the victim dials now
            await s.close()
        except trio.TooSlowError:
            self.counts["dcutr_sessions_timed_out"] += 1
        except Exception as exc:   # a reset stream: py-libp2p raises its own types
            self.counts["dcutr_sessions_refused"] += 1
            log.debug("dcutr session: %s", exc)

    # ----------------------------------------------------------------------------------------- relay
    async def _hop(self, t: Libp2pTransport, msg: HopMessage) -> tuple[int, Any]:
        s = await t.host.new_stream(ID.from_base58(self.boot), [HOP])
        await write_delimited_msg(s, msg)
        with trio.fail_after(15):
            resp = await read_delimited_msg(s, HopMessage)
        return int(resp.status), s

    async def reserve(self, t: Libp2pTransport) -> None:
        try:
            code, s = await self._hop(t, HopMessage(type=HopMessage.RESERVE))
            await s.close()
            self.counts["reserve_ok" if code == StatusCode.OK else "reserve_refused"] += 1
        except Exception as exc:
            self.counts["reserve_failed"] += 1
            log.debug("reserve: %s", exc)

    async def circuits(self) -> None:
        """All sybils reserve once, then open circuits to the victim at once, hold them, drop them; again."""
        await self.first_circuit.wait()
        async with trio.open_nursery() as n:
            for t in self.sybils:
                n.start_soon(self.reserve, t)
        connect = HopMessage(type=HopMessage.CONNECT, peer=CircuitPeerId(id=ID.from_base58(self.victim).to_bytes()))
        while True:
            async with trio.open_nursery() as n:
                for t in self.sybils:
                    n.start_soon(self._circuit, t, connect)
            self.counts["circuit_rounds"] += 1
            await trio.sleep(1)

    async def _circuit(self, t: Libp2pTransport, connect: HopMessage) -> None:
        try:
            code, s = await self._hop(t, connect)
        except Exception as exc:
            self.counts["circuit_failed"] += 1
            log.debug("circuit: %s", exc)
            return
        if code != StatusCode.OK:
            self.counts[f"circuit_refused_{StatusCode(code).name if code in StatusCode._value2member_map_ else code}"] += 1
            await s.close()
            return
        self.counts["circuit_ok"] += 1
        self.circuits_held += 1
        self.circuits_held_max = max(self.circuits_held_max, self.circuits_held)
        try:
            await trio.sleep(4)      # held, never upgraded: then dropped, as the cutting attack did
        finally:
            self.circuits_held -= 1
            with trio.CancelScope(shield=True), trio.move_on_after(2):
                await s.reset()

    # ----------------------------------------------------------------------------------------- reach
    async def reach(self) -> None:
        addrs = [f"/ip4/{self.ip}/tcp/{p}" for p in DROP_PORTS]
        async with trio.open_nursery() as n:
            while True:
                for t in self.sybils:
                    n.start_soon(self._check, t, addrs)
                await trio.sleep(5.2)   # the service's min_interval per requester is 5 s

    async def _check(self, t: Libp2pTransport, addrs: list[str]) -> None:
        t0 = time.monotonic()
        try:
            reply = wr.decode_check_reply(await _request(t, self.boot, wr.encode("check", p2p=addrs, data=[]), 30))
        except (PeerUnavailable, RemoteProtocolError) as exc:
            self.counts["check_failed"] += 1
            log.debug("check: %s", exc)
            return
        if reply.refused:
            self.counts["check_refused_per_ip" if "from your address" in reply.refused else
                        f"check_refused_{reply.refused.split(':')[0][:20]}"] += 1
        else:
            self.counts["check_served"] += 1
            self.counts["check_served_seconds_max"] = max(self.counts["check_served_seconds_max"],
                                                          round(time.monotonic() - t0))

    def report(self) -> dict[str, Any]:
        return {"did": dict(self.counts), "victim": self.victim, "circuits_held_max": self.circuits_held_max,
                "dcutr_listeners": self.punch_ports.report(), "record_listeners": self.record_ports.report()}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    until = time.monotonic() + args.duration
    punch_ports, record_ports = Counting(), Counting()
    async with trio.open_nursery() as outer:
        await punch_ports.open(outer, args.ip, 16)
        await record_ports.open(outer, args.ip, 16)
        announce = tuple(f"/ip4/{args.ip}/tcp/{p}" for p in record_ports.ports)
        cfg = Libp2pConfig(listen=(f"/ip4/{args.ip}/tcp/0",), announce=announce)
        async with open_libp2p_transport(Identity.generate(), cfg) as member:
            swarm = _Liar(member, SwarmConfig(heartbeat=1.0, dead_timeout=10.0, probing=False, probe=ProbeConfig()),
                          PROFILE)
            async with trio.open_nursery() as nursery:
                await nursery.start(swarm.run, [args.bootstrap])
                sybils = []
                for _ in range(args.sybils):
                    t = await outer.start(_sybil, args)
                    await t.connect(args.bootstrap)
                    sybils.append(t)
                atk = NetAttacker(args, member, swarm, sybils, punch_ports, record_ports)
                # until --duration is up or SIGTERM (the test stops it once the honest job is done)
                with trio.move_on_after(max(0.0, until - time.monotonic())) as attack, \
                        trio.open_signal_receiver(signal.SIGTERM) as signals:
                    async with trio.open_nursery() as n:
                        n.start_soon(_cancel_on_signal, signals, attack)
                        n.start_soon(atk.reach)     # from the start: honest nodes joining now are checked under it
                        await swarm.wait_until(atk.find_victim, args.duration)
                        print("attacking", atk.victim, flush=True)
                        for task in (atk.dcutr, atk.circuits):
                            n.start_soon(task)
                nursery.cancel_scope.cancel()
        outer.cancel_scope.cancel()
    return atk.report()


async def _cancel_on_signal(signals: Any, scope: trio.CancelScope) -> None:
    async for _ in signals:
        scope.cancel()
        return


async def _sybil(args: argparse.Namespace, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
    """A throwaway identity on the same IP, kept open until the attack's nursery ends."""
    async with open_libp2p_transport(Identity.generate(), Libp2pConfig(listen=(f"/ip4/{args.ip}/tcp/0",))) as t:
        task_status.started(t)
        await trio.sleep_forever()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.system.net_attacker")
    ap.add_argument("--bootstrap", required=True)
    ap.add_argument("--ip", required=True, help="this host's address (listeners, the identities' addresses)")
    ap.add_argument("--sybils", type=int, default=10)
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--report", type=Path)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    # a SIGTERM ends the attack (run's signal receiver); one that lands after --duration ended it, while the
    # report is written, is ignored: it used to kill the tool there (-15) and fail the live test
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        report = trio.run(run, args)
    except BaseExceptionGroup as exc:
        log.error("attacker died: %r", exc)
        return 1
    text = json.dumps(report, indent=1, sort_keys=True)
    if args.report is not None:
        args.report.write_text(text)
    print(text, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
