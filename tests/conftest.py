"""Shared test fixtures: keep libp2p's logger quiet and torch single-threaded in tests."""

import logging

import torch

logging.getLogger("libp2p").setLevel(logging.CRITICAL)
logging.getLogger("libp2p").propagate = False
torch.set_num_threads(1)
