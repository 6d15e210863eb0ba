"""The ops ASGI app, called directly: routes, read-only methods, headers, Host check, size bound."""

from __future__ import annotations

import json
from typing import Any

import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from fusionp2p.errors import ConfigError
from fusionp2p.ops.http import HttpConfig, OpsApp, parse_http_addr

A, B = "12D3KooWA", "12D3KooWB"


def sample() -> dict[str, Any]:
    return {
        "schema": 1, "at": 0.0,
        "node": {"peer": A, "role": "node", "uptime_s": 3.0, "addrs": [], "profile": None, "heartbeat_s": 1.0},
        "members": [{"peer": A, "role": "node", "alive": True}], "members_truncated": False,
        "alive_by_role": {"node": 2, "bootstrap": 1}, "dead": 1,
        "bandwidth": {"peers": [A, B], "bytes_per_s": [[None, 1e8], [2e8, None]], "rtt_s": [[None, 0.001], [None, None]],
                      "measured": [[False, True], [False, False]], "truncated": False},
        "traffic": [{"peer": B, "plane": "data", "sent": 10, "received": 20}], "traffic_truncated": False,
        "traffic_totals": {"data": {"sent": 10, "received": 20}},
        "jobs": [{"job": "j1", "state": "running", "progress": {"step": 4, "loss": 2.5, "tokens_per_s": 99.0},
                  "local": {"stage": 1, "replica": 0, "step_s": 0.5, "compute_util": 0.8, "tokens_per_s": 50.0,
                            "averaging": {"rounds": 3, "skipped": 1, "seconds": 1.5, "last_s": 0.4}},
                  "plan": {"fences": [{"index": 0, "rho": 0.25}]}}],
        "jobs_truncated": False, "jobs_by_state": {"running": 1},
        "refusals": {"total": 4, "by_reason": {"gossip/decode": 4}, "truncated": False},
        "counters": {"bad_records": 0},
    }


class FakeState:
    def __init__(self, snap: dict[str, Any]) -> None:
        self.snap = snap

    def snapshot(self) -> dict[str, Any]:
        return self.snap


def call(app: OpsApp, path: str, *, method: str = "GET", host: str = "127.0.0.1:9100") -> tuple[int, dict[str, str], bytes]:
    out: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(m: dict[str, Any]) -> None:
        out.append(m)

    scope = {"type": "http", "method": method, "path": path, "query_string": b"", "headers": [(b"host", host.encode())]}
    trio.run(app, scope, receive, send)
    headers = {k.decode(): v.decode() for k, v in out[0]["headers"]}
    return out[0]["status"], headers, out[1]["body"]


@pytest.fixture
def app() -> OpsApp:
    return OpsApp(FakeState(sample()), HttpConfig(host="127.0.0.1", port=9100))  # type: ignore[arg-type]


def test_dashboard_and_static_files(app: OpsApp) -> None:
    status, h, body = call(app, "/")
    assert status == 200 and h["content-type"].startswith("text/html") and b"dashboard.js" in body
    for name, kind in (("dashboard.js", "javascript"), ("dashboard.css", "css")):
        status, h, body = call(app, f"/static/{name}")
        assert status == 200 and kind in h["content-type"] and len(body) == int(h["content-length"]) > 100
    assert call(app, "/static/../http.py")[0] == 404
    assert call(app, "/static/")[0] == 404


def test_api_sections_and_status(app: OpsApp) -> None:
    status, h, body = call(app, "/api/status")
    assert status == 200 and h["content-type"] == "application/json"
    assert json.loads(body)["jobs"][0]["job"] == "j1"
    assert json.loads(call(app, "/api/bandwidth")[2]) == {"bandwidth": sample()["bandwidth"]}
    assert set(json.loads(call(app, "/api/jobs")[2])) == {"jobs", "jobs_truncated", "jobs_by_state"}
    assert call(app, "/api/nothing")[0] == 404


def test_metrics_parse_with_prometheus_parser(app: OpsApp) -> None:
    status, h, body = call(app, "/metrics")
    assert status == 200 and h["content-type"].startswith("text/plain; version=0.0.4")
    fams = {f.name: f for f in text_string_to_metric_families(body.decode())}
    val = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in fams.values() for s in f.samples}
    assert val[("fusionp2p_members", (("role", "node"),))] == 2
    assert val[("fusionp2p_traffic_received_bytes_total", (("peer", B), ("plane", "data")))] == 20
    assert val[("fusionp2p_bandwidth_bytes_per_second", (("dst", B), ("measured", "yes"), ("src", A)))] == 1e8
    assert val[("fusionp2p_jobs", (("state", "running"),))] == 1
    assert val[("fusionp2p_job_loss", (("job", "j1"),))] == 2.5
    assert val[("fusionp2p_averaging_rounds_total", (("job", "j1"), ("outcome", "skipped"), ("stage", "1")))] == 1
    assert val[("fusionp2p_fence_kept_ratio", (("fence", "0"), ("job", "j1")))] == 0.25
    assert val[("fusionp2p_refused_messages_total", (("reason", "gossip/decode"),))] == 4


def test_read_only_and_safe_headers(app: OpsApp) -> None:
    for method in ("POST", "PUT", "DELETE", "PATCH"):
        status, h, _ = call(app, "/api/status", method=method)
        assert status == 405 and h["allow"] == "GET, HEAD"
    status, h, body = call(app, "/api/status", method="HEAD")
    assert status == 200 and body == b"" and int(h["content-length"]) > 0
    assert h["cache-control"] == "no-store" and h["x-content-type-options"] == "nosniff"
    assert "frame-ancestors 'none'" in h["content-security-policy"] and "script-src 'self'" in h["content-security-policy"]


def test_loopback_server_answers_only_loopback_hosts(app: OpsApp) -> None:
    for host in ("127.0.0.1:9100", "localhost:9100", "[::1]:9100", "localhost"):
        assert call(app, "/api/status", host=host)[0] == 200
    assert call(app, "/api/status", host="attacker.example:9100")[0] == 421
    public = OpsApp(FakeState(sample()), HttpConfig(host="0.0.0.0", port=9100))  # type: ignore[arg-type]
    assert call(public, "/api/status", host="node1.example:9100")[0] == 200


def test_responses_are_bounded() -> None:
    app = OpsApp(FakeState({"big": "x" * 5000, **sample()}), HttpConfig(max_response=2048))  # type: ignore[arg-type]
    assert call(app, "/api/status")[0] == 503


def test_a_failing_snapshot_is_a_500_not_a_crash() -> None:
    class Broken:
        def snapshot(self) -> dict[str, Any]:
            raise KeyError("bug")

    assert call(OpsApp(Broken(), HttpConfig()), "/metrics")[0] == 500  # type: ignore[arg-type]


@pytest.mark.parametrize(("addr", "host", "port"), [
    ("9100", "127.0.0.1", 9100), ("0.0.0.0:9100", "0.0.0.0", 9100), ("[::1]:0", "::1", 0), ("10.0.0.5:80", "10.0.0.5", 80),
])
def test_parse_http_addr(addr: str, host: str, port: int) -> None:
    cfg = parse_http_addr(addr)
    assert (cfg.host, cfg.port) == (host, port)


@pytest.mark.parametrize("addr", ["", "localhost:9100", "9100:x", "1.2.3.4:99999", "::1:9100", "unix:/tmp/s",
                                  "\u00b2", "127.0.0.1:\u00b2", "9" * 5000])   # isdigit() accepts "²", int() refuses it
def test_bad_http_addr_is_a_config_error(addr: str) -> None:
    with pytest.raises(ConfigError, match="--http"):
        parse_http_addr(addr)
