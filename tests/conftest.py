"""Shared fixtures: tiny randomly initialised models built in code (no download, milliseconds per forward).

The tests marked ``device`` (the lossless tests of the engine and the drafters, and the host-sync counts) run on
``$DRAFTBENCH_TEST_DEVICE`` (default cpu): their tiny models and every tensor they draft are made on
:data:`DEVICE`. ``make gpu-check`` runs them on a GPU with ``DRAFTBENCH_TEST_DEVICE=cuda pytest -m device``; the
other tests are the CPU's: run them without it.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch
from hypothesis import settings
from transformers import Gemma3ForCausalLM, LlamaForCausalLM

from evaluation import models, tiny
from evaluation.tiny import VOCAB  # noqa: F401 -- the tests' vocabulary, imported from here

DEVICE = torch.device(os.environ.get(tiny.TEST_DEVICE, "cpu"))
tiny_llama = functools.partial(tiny.tiny_llama, device=DEVICE)
tiny_gemma3 = functools.partial(tiny.tiny_gemma3, device=DEVICE)
tiny_qwen2 = functools.partial(tiny.tiny_qwen2, device=DEVICE)
tiny_qwen3 = functools.partial(tiny.tiny_qwen3, device=DEVICE)

# One thread: these machines are shared, and torch's OpenMP threads slow down by orders of magnitude when
# another process competes for the cores; the tests assert behaviour, never speed.
torch.set_num_threads(1)

# The device's default for every test alike (models.load sets it, and a test that built its model in code would
# otherwise see whatever an earlier test in its worker left); tests of the other path patch it.
os.environ[models.MASKED_GQA] = "1" if DEVICE.type == "cpu" else "0"

# Nor does hypothesis time examples: two test workers on two shared cores make any deadline flaky.
settings.register_profile("draftbench", deadline=None)
settings.load_profile("draftbench")


@pytest.fixture(scope="session")
def llama() -> LlamaForCausalLM:
    return tiny_llama()


@pytest.fixture(scope="session")
def gemma3() -> Gemma3ForCausalLM:
    return tiny_gemma3()
