"""Shared test setup: keep libp2p's logger quiet, torch single-threaded, and hypothesis deterministic."""

import logging
import os
from collections.abc import Generator
from typing import Any

import pytest
import torch
from hypothesis import settings

logging.getLogger("libp2p").setLevel(logging.CRITICAL)
logging.getLogger("libp2p").propagate = False
torch.set_num_threads(1)

# The same examples on every run (a property test that found a new counterexample on a CI run and not
# on the developer's would make CI flaky); explore with HYPOTHESIS_PROFILE=explore.
settings.register_profile("ci", derandomize=True, print_blob=True)
settings.register_profile("explore", derandomize=False, max_examples=1000)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


# A real-process test that fails shows the end of every process log its run wrote (LocalCluster writes
# <home>/<name>.log under the test's temporary directories): pytest keeps only the last three base
# directories, and a stall in CI was once left unexplained because its node logs were gone.
_LOG_TAIL = 120      # lines per log
_LOG_FILES = 16


def _process_logs(config: pytest.Config, since: float) -> list[tuple[str, str]]:
    factory = getattr(config, "_tmp_path_factory", None)
    if factory is None:
        return []
    base = factory.getbasetemp()
    logs = sorted((p for p in base.rglob("*.log") if p.stat().st_mtime >= since), key=lambda p: str(p))
    out = []
    for p in logs[:_LOG_FILES]:
        lines = p.read_text(errors="replace").splitlines()
        out.append((str(p.relative_to(base)), "\n".join(lines[-_LOG_TAIL:])))
    return out


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, None]:
    outcome = yield
    rep = outcome.get_result()
    if rep.when == "call" and rep.failed and item.get_closest_marker("system") is not None:
        for name, text in _process_logs(item.config, since=call.start):
            rep.sections.append((f"process log {name} (last {_LOG_TAIL} lines)", text))
