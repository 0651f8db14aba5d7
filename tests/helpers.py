"""Test helpers: configs composed exactly as `python -m evaluation.run` composes them, a tiny checkpoint."""

from __future__ import annotations

from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from methods.paths import PROJECT_ROOT

CONF = PROJECT_ROOT / "conf"


def config(*overrides: str, name: str = "config") -> DictConfig:
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        return compose(name, overrides=list(overrides))


def method_names() -> list[str]:
    return sorted(p.stem for p in (CONF / "method").glob("*.yaml"))


def tiny_checkpoint(directory: Path, max_positions: int = 512, ends: bool = True) -> Path:
    """A tiny random Llama with a word-level tokenizer, saved as a local checkpoint (``model=hf``).

    ``ends=False``: the tokenizer's [EOS] lies outside the model's vocabulary, so every answer runs to
    max_new_tokens (a question that takes long enough to be interrupted in the middle)."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

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
