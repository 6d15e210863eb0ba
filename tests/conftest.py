"""Shared test setup: keep libp2p's logger quiet, torch single-threaded, and hypothesis deterministic."""

import logging
import os

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
