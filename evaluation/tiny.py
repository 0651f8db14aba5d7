"""Tiny random models built in code (no download, milliseconds per forward): the tests' models and ``make gpu-check``'s.

Each is seeded and built on the CPU, then moved to ``device``: the same weights on every device, so a CPU and a
GPU run of a test verify the same model. The tests move them to ``$DRAFTBENCH_TEST_DEVICE`` (:data:`TEST_DEVICE`,
default cpu; tests/conftest.py), which ``make gpu-check`` sets to run the lossless tests on a GPU.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM, Qwen2Config,
                          Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

VOCAB = 64
# The device the tests marked ``device`` build their models and drafts on (tests/conftest.py reads it).
TEST_DEVICE = "DRAFTBENCH_TEST_DEVICE"


def tiny_llama(seed: int = 0, device: torch.device | str = "cpu") -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, eos_token_id=None, bos_token_id=None, pad_token_id=None,
    )
    return LlamaForCausalLM(config).eval().to(device)


def tiny_gemma3(seed: int = 0, sliding_window: int = 8, device: torch.device | str = "cpu") -> Gemma3ForCausalLM:
    torch.manual_seed(seed)
    config = Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=512, sliding_window=sliding_window,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        eos_token_id=None, bos_token_id=None, pad_token_id=None,
    )
    return Gemma3ForCausalLM(config).eval().to(device)


def _randomize(model: torch.nn.Module, suffixes: tuple[str, ...], mean: float) -> torch.nn.Module:
    """Random values for parameters that initialise to a constant (biases to 0, norms to 1), so they matter."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(suffixes):
                param.normal_(mean, 0.5)
    return model


def tiny_qwen2(seed: int = 0, device: torch.device | str = "cpu") -> Qwen2ForCausalLM:
    """Qwen2: biases on the q/k/v projections."""
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, eos_token_id=None, bos_token_id=None, pad_token_id=None,
    )
    return _randomize(Qwen2ForCausalLM(config).eval(), ("proj.bias",), 0.0).to(device)


def tiny_qwen3(seed: int = 0, device: torch.device | str = "cpu") -> Qwen3ForCausalLM:
    """Qwen3: RMS norms on queries and keys (per head, before RoPE)."""
    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=512, eos_token_id=None, bos_token_id=None,
        pad_token_id=None,
    )
    return _randomize(Qwen3ForCausalLM(config).eval(), ("q_norm.weight", "k_norm.weight"), 1.0).to(device)


def tiny_checkpoint(directory: Path, max_positions: int = 512, ends: bool = True) -> Path:
    """A tiny random Llama with a word-level tokenizer, saved as a local checkpoint (``model=hf``).

    ``ends=False``: the tokenizer's [EOS] lies outside the model's vocabulary, so every answer runs to
    max_new_tokens (a question that takes long enough to be interrupted in the middle)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["[UNK]", "[EOS]"] + [chr(c) for c in range(ord("a"), ord("z") + 1)] + ["Question:", "Answer:"]
    if not ends:
        words = [words[0], *words[2:], "[EOS]"]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", eos_token="[EOS]")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(words) - (not ends), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
                         eos_token_id=1 if ends else None, bos_token_id=None, pad_token_id=None)
    LlamaForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory
