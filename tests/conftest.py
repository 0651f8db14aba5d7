"""Shared fixtures: tiny randomly initialised models built in code (no download, milliseconds per forward)."""

from __future__ import annotations

import pytest
import torch
from transformers import Gemma3TextConfig, Gemma3ForCausalLM, LlamaConfig, LlamaForCausalLM

VOCAB = 64

# One thread: these machines are shared, and torch's OpenMP threads slow down by orders of magnitude when
# another process competes for the cores; the tests assert behaviour, never speed.
torch.set_num_threads(1)


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


@pytest.fixture(scope="session")
def llama() -> LlamaForCausalLM:
    return tiny_llama()


@pytest.fixture(scope="session")
def gemma3() -> Gemma3ForCausalLM:
    return tiny_gemma3()
