"""Current chat models: their configs' stop tokens and chat templates, and loading by hub id (offline here).

The hub is not reachable from the test machines, so each model family's tokenizer is built in code with its
special tokens, its tokenizer config's eos token and its generation config's eos ids, and a chat template
in the family's format (the real templates also handle system prompts and tools).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models as tokenizer_models, pre_tokenizers
from transformers import GenerationConfig, PreTrainedTokenizerFast
from transformers.integrations.sdpa_attention import use_gqa_in_sdpa

from evaluation import models
from helpers import PROJECT_ROOT, config, tiny_checkpoint

LLAMA3 = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
          "{{ m['content'] }}<|eot_id|>{% endfor %}"
          "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
LLAMA3_SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>",
                  "<|eot_id|>"]
QWEN_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# model config -> (special tokens, template, tokenizer_config.json's eos, generation_config.json's eos tokens,
# the tokens that end an assistant turn), as the published checkpoints have them.
FAMILIES = {
    "llama3.1-8b-instruct": (LLAMA3_SPECIAL, LLAMA3, "<|eot_id|>", ["<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"],
                             {"<|eot_id|>", "<|eom_id|>", "<|end_of_text|>"}),
    "qwen2.5-7b-instruct": (QWEN_SPECIAL, CHATML, "<|im_end|>", ["<|im_end|>", "<|endoftext|>"],
                            {"<|im_end|>", "<|endoftext|>"}),
    "qwen3-8b": (QWEN_SPECIAL, CHATML, "<|im_end|>", ["<|im_end|>", "<|endoftext|>"], {"<|im_end|>", "<|endoftext|>"}),
}


def family_tokenizer(special: list[str], template: str, eos: str) -> PreTrainedTokenizerFast:
    words = ["[UNK]", "user", "assistant", "a", "b", "c"]
    vocab = {w: i for i, w in enumerate(words + special)}
    backend = Tokenizer(tokenizer_models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    bos = special[0] if special[0].startswith("<|begin") else None
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", bos_token=bos, eos_token=eos,
                                   additional_special_tokens=special, chat_template=template)


@pytest.mark.parametrize("name", FAMILIES)
def test_every_turn_ending_token_stops_generation(name):
    special, template, eos, generation_eos, turn_enders = FAMILIES[name]
    cfg = config(f"model={name}").model
    tokenizer = family_tokenizer(special, template, eos)
    ids = tokenizer.convert_tokens_to_ids
    expected = {ids(t) for t in turn_enders}
    published = GenerationConfig(eos_token_id=[ids(t) for t in generation_eos])
    assert models.stop_token_ids(tokenizer, published, cfg.stop_tokens) == expected
    # a local checkpoint without generation_config.json: the model config alone names every stop token
    assert models.stop_token_ids(tokenizer, GenerationConfig(), cfg.stop_tokens) == expected
    # the token the chat template closes an assistant turn with is among them
    conversation = [{"role": "user", "content": "a b"}, {"role": "assistant", "content": "c"}]
    rendered = tokenizer.apply_chat_template(conversation, tokenize=False)
    closing = tokenizer(rendered, add_special_tokens=False).input_ids
    assert closing[closing.index(ids("c")) + 1] in expected


@pytest.mark.parametrize("name", FAMILIES)
def test_the_prompt_ends_with_the_assistant_header(name):
    special, template, eos, _, _ = FAMILIES[name]
    cfg = config(f"model={name}").model
    assert cfg.template == "chat"  # the checkpoint's own template
    tokenizer = family_tokenizer(special, template, eos)
    prompt = models.prompt_ids(tokenizer, cfg.template, [{"role": "user", "content": "a b"}])
    tokens = tokenizer.convert_ids_to_tokens(prompt)
    assert tokens[-3:] == ["<|start_header_id|>", "assistant", "<|end_header_id|>"] or tokens[-2:] == [
        "<|im_start|>", "assistant"]
    assert tokens.count("a") == 1 and "[UNK]" not in tokens


def test_an_unknown_stop_token_is_named():
    tokenizer = family_tokenizer(QWEN_SPECIAL, CHATML, "<|im_end|>")
    with pytest.raises(ValueError, match=r"stop_tokens names \['<\|eot_id\|>'\]"):
        models.stop_token_ids(tokenizer, GenerationConfig(), ["<|im_end|>", "<|eot_id|>"])


def hub_cache(root: Path, repo: str, checkpoint: Path) -> Path:
    """A Hugging Face hub cache holding ``checkpoint`` as ``repo``, as a download would leave it."""
    commit = "0" * 40
    repo_dir = root / "hub" / f"models--{repo.replace('/', '--')}"
    (repo_dir / "refs").mkdir(parents=True)
    (repo_dir / "refs" / "main").write_text(commit)
    snapshot = repo_dir / "snapshots" / commit
    snapshot.parent.mkdir(parents=True)
    checkpoint.rename(snapshot)
    return snapshot


def offline(home: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HOME": str(home), "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, *args], cwd=PROJECT_ROOT, env=env, capture_output=True, text=True)


def test_a_hub_id_loads_from_the_hub_cache_offline(tmp_path):
    snapshot = hub_cache(tmp_path / "hf", "test-org/tiny-chat", tiny_checkpoint(tmp_path / "tiny"))
    proc = offline(tmp_path / "hf", "-c", "from evaluation.models import weights_dir; "
                                          "print(weights_dir({'name': 'hf', 'path': 'test-org/tiny-chat'}))")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(snapshot)


def test_a_hub_id_without_the_hub_is_a_clear_message(tmp_path):
    proc = offline(tmp_path / "hf", "-m", "evaluation.run", "model=qwen2.5-7b-instruct", "data.limit=1")
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    assert "model.path=Qwen/Qwen2.5-7B-Instruct is not a local directory" in proc.stderr
    assert "HF_HUB_OFFLINE" in proc.stderr and "hf download Qwen/Qwen2.5-7B-Instruct --local-dir" in proc.stderr


def test_sdpa_attends_over_the_key_value_heads_under_a_mask_on_cpu_only(tmp_path, monkeypatch):
    monkeypatch.delenv(models.MASKED_GQA, raising=False)
    assert models.masked_gqa(torch.device("cpu")) and not models.masked_gqa(torch.device("cuda"))
    monkeypatch.setenv(models.MASKED_GQA, "0")  # the user's choice wins
    assert not models.masked_gqa(torch.device("cpu"))
    monkeypatch.delenv(models.MASKED_GQA)
    models.load({"name": "hf", "path": str(tiny_checkpoint(tmp_path))}, torch.device("cpu"), torch.float32)
    key = torch.zeros(1, 2, 4, 8)  # what transformers decides from the variable load set: GQA despite the mask
    assert use_gqa_in_sdpa(torch.zeros(1, 1, 2, 4), key, key)
