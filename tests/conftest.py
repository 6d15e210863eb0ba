"""Shared test setup: keep libp2p's logger quiet, torch single-threaded, and hypothesis deterministic."""

import logging
import os

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


# Real-process variants that stalled under load and are not yet understood: they run in `make test-all`
# (marked slow here) until the cause is found. The same paths run in `make test` through the embedded
# variant and tests/system/test_elastic_processes.py.
#   - a member SIGKILLed mid-training on 4 node processes: "no event within 300 s" in 2 of 5 runs at load
#     2.6 or more (helpers or two CPU burners beside the suite), green in the 3 others.
_SLOW_UNDER_LOAD = ("tests/system/test_job_conformance.py::"
                    "test_a_member_killed_mid_training_the_job_replans_and_ends_done[processes]",)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.nodeid in _SLOW_UNDER_LOAD:
            item.add_marker(pytest.mark.slow)
