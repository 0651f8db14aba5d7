"""Shared fixtures: tiny randomly initialised models built in code (no download, milliseconds per forward)."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import settings
from transformers import (Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM, Qwen2Config,
                          Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

from evaluation import models

VOCAB = 64

# One thread: these machines are shared, and torch's OpenMP threads slow down by orders of magnitude when
# another process competes for the cores; the tests assert behaviour, never speed.
torch.set_num_threads(1)

# The CPU default for every test alike (models.load sets it, and a test that built its model in code would
# otherwise see whatever an earlier test in its worker left); tests of the other path patch it.
os.environ[models.MASKED_GQA] = "1"

# Nor does hypothesis time examples: two test workers on two shared cores make any deadline flaky.
settings.register_profile("draftbench", deadline=None)
settings.load_profile("draftbench")


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, eos_token_id=None, bos_token_id=None, pad_token_id=None,
    )
    return LlamaForCausalLM(config).eval()


def tiny_gemma3(seed: int = 0, sliding_window: int = 8) -> Gemma3ForCausalLM:
    torch.manual_seed(seed)
    config = Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=512, sliding_window=sliding_window,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        eos_token_id=None, bos_token_id=None, pad_token_id=None,
    )
    return Gemma3ForCausalLM(config).eval()


def _randomize(model: torch.nn.Module, suffixes: tuple[str, ...], mean: float) -> torch.nn.Module:
    """Random values for parameters that initialise to a constant (biases to 0, norms to 1), so they matter."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(suffixes):
                param.normal_(mean, 0.5)
    return model


def tiny_qwen2(seed: int = 0) -> Qwen2ForCausalLM:
    """Qwen2: biases on the q/k/v projections."""
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, eos_token_id=None, bos_token_id=None, pad_token_id=None,
    )
    return _randomize(Qwen2ForCausalLM(config).eval(), ("proj.bias",), 0.0)


def tiny_qwen3(seed: int = 0) -> Qwen3ForCausalLM:
    """Qwen3: RMS norms on queries and keys (per head, before RoPE)."""
    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=512, eos_token_id=None, bos_token_id=None,
        pad_token_id=None,
    )
    return _randomize(Qwen3ForCausalLM(config).eval(), ("q_norm.weight", "k_norm.weight"), 1.0)


@pytest.fixture(scope="session")
def llama() -> LlamaForCausalLM:
    return tiny_llama()


@pytest.fixture(scope="session")
def gemma3() -> Gemma3ForCausalLM:
    return tiny_gemma3()
