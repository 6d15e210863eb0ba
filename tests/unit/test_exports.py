"""The public API is a curated list (STYLE.md 10): every name in __all__ resolves, nothing else leaks."""

import subprocess
import sys

import fusionp2p

EXPECTED = {
    "CO2", "AdaTopK", "ConfigError", "FusionError", "IntegrityError", "Job", "JobError", "LRSchedule",
    "LocalProtocolError", "PeerUnavailable", "PlanError", "ProtocolError", "RemoteProtocolError", "Swarm",
    "TrainConfig", "__version__", "data", "empty_parameters", "models", "trace",
}


def test_all_is_pinned() -> None:
    assert set(fusionp2p.__all__) == EXPECTED


def test_every_export_resolves() -> None:
    for name in fusionp2p.__all__:
        assert getattr(fusionp2p, name) is not None


def test_user_errors_are_value_errors() -> None:
    assert issubclass(fusionp2p.ConfigError, ValueError)
    assert issubclass(fusionp2p.RemoteProtocolError, fusionp2p.FusionError)


def test_cli_control_plane_does_not_import_torch() -> None:
    code = "import sys, fusionp2p, fusionp2p.cli, fusionp2p.swarm.node, fusionp2p.swarm.daemon; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "False"
