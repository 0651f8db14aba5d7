"""Checkpoints as published: Vicuna-style (a SentencePiece tokenizer.model and nothing else for the tokenizer,
float16 weights as .bin shards or as safetensors) run end to end; a missing model.path is named, not looked up."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import sentencepiece
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from evaluation import models
from methods.paths import PROJECT_ROOT
from evaluation.run import run
from helpers import config

WORDS = "a b c d e f g h i j k l m n o p q r s t u v w x y z".split()


def _added(content: str) -> dict:
    """A special token as transformers 4.2x wrote it into Llama 1 / Vicuna tokenizer configs."""
    return {"__type": "AddedToken", "content": content, "lstrip": False, "normalized": True, "rstrip": False,
            "single_word": False}


def sentencepiece_tokenizer(directory: Path) -> Path:
    """Vicuna v1.3's tokenizer files: a byte-fallback BPE tokenizer.model (<unk> <s> </s> = 0 1 2) and its
    tokenizer_config.json / special_tokens_map.json, no tokenizer.json; trained here on a few lines."""
    lines = [" ".join(WORDS[i:] + WORDS[:i]) for i in range(26)] + ["Question: what is it? Answer: it is."] * 4
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=model, vocab_size=300, model_type="bpe", byte_fallback=True,
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1, character_coverage=1.0, minloglevel=2)
    directory.mkdir(parents=True)
    (directory / "tokenizer.model").write_bytes(model.getvalue())
    special = {"bos_token": _added("<s>"), "eos_token": _added("</s>"), "unk_token": _added("<unk>")}
    (directory / "special_tokens_map.json").write_text(json.dumps(special))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        **special, "add_bos_token": True, "add_eos_token": False, "clean_up_tokenization_spaces": False,
        "model_max_length": 2048, "pad_token": None, "padding_side": "right", "sp_model_kwargs": {},
        "tokenizer_class": "LlamaTokenizer"}))
    return directory


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """The same tiny random float16 Llama twice: safetensors, and sharded PyTorch .bin files as Vicuna ships;
    ``weights`` holds its state dict, to compare with what loads."""
    root = tmp_path_factory.mktemp("vicuna-like")
    tokenizer = sentencepiece_tokenizer(root / "tokenizer")
    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(
        vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )).half()
    found = {}
    for kind in ("safetensors", "bin"):
        directory = found[kind] = root / kind
        llama.save_pretrained(directory, max_shard_size="20KB")
        for file in tokenizer.iterdir():
            shutil.copy(file, directory)
    # transformers 5 writes safetensors only: the .bin shards and their index as transformers 4 wrote them
    for file in [*found["bin"].glob("*.safetensors"), found["bin"] / "model.safetensors.index.json"]:
        file.unlink()
    state = llama.state_dict()
    names = list(state)
    shards = {f"pytorch_model-0000{i + 1}-of-00002.bin": names[i::2] for i in range(2)}
    for file, keys in shards.items():
        torch.save({k: state[k] for k in keys}, found["bin"] / file)
    (found["bin"] / "pytorch_model.bin.index.json").write_text(json.dumps({
        "metadata": {"total_size": sum(t.numel() * t.element_size() for t in state.values())},
        "weight_map": {k: file for file, keys in shards.items() for k in keys}}))
    torch.save(state, root / "weights.pt")
    found["weights"] = root / "weights.pt"
    return found


@pytest.mark.parametrize("kind", ["safetensors", "bin"])
def test_a_vicuna_style_checkpoint_runs_and_recycling_equals_greedy(checkpoints, kind, tmp_path):
    directory = checkpoints[kind]
    assert not (directory / "tokenizer.json").exists() and len(list(directory.glob(f"*.{kind}"))) > 1
    assert not list(directory.glob("*.safetensors" if kind == "bin" else "*.bin"))

    loaded = models.load({"name": "hf", "path": str(directory)}, torch.device("cpu"), torch.float32)
    text = "Question: a b c d e Answer: é"  # é: not in the training text, so byte fallback
    sp = sentencepiece.SentencePieceProcessor(model_file=str(directory / "tokenizer.model"))
    assert loaded.tokenizer(text).input_ids == [1, *sp.encode(text)]  # <s>, then SentencePiece's own pieces
    assert loaded.eos_token_ids == {2} and loaded.model.dtype == torch.float32  # float16 on disk, as asked
    weights = torch.load(checkpoints["weights"])
    assert all(torch.equal(v, weights[k].float()) for k, v in loaded.model.state_dict().items())  # not re-initialised

    data = tmp_path / "q.jsonl"
    data.write_text("".join(json.dumps({"question_id": i, "category": "qa", "turns": [" ".join(WORDS[i:i + 9])]})
                            + "\n" for i in range(2)))
    outputs = {}
    for method in ("baseline", "recycling"):
        path = run(config("model=hf", f"model.path={directory}", "model.template=plain", f"data.path={data}",
                          f"method={method}", "max_new_tokens=24", "dtype=float32", "device=cpu", "threads=1",
                          "warmup=0", f"run.dir={tmp_path / 'out'}", "run.progress=false"))
        records = [json.loads(line) for line in path.read_text().splitlines()]
        outputs[method] = {r["question_id"]: r["choices"][0]["output_ids"] for r in records}
    assert sorted(outputs["baseline"]) == [0, 1] and all(outputs["baseline"].values())
    assert outputs["recycling"] == outputs["baseline"]


def test_an_accelerator_gets_the_weights_straight_from_the_checkpoint(checkpoints, monkeypatch):
    """On a GPU, from_pretrained places every tensor itself (device_map): no full copy in host memory first."""
    seen = []

    def from_pretrained(path, **kwargs):
        seen.append(kwargs)
        raise InterruptedError  # what happens next needs the device

    monkeypatch.setattr(models.AutoModelForCausalLM, "from_pretrained", from_pretrained)
    monkeypatch.setenv(models.MASKED_GQA, "1")  # load() sets it for the device; restored after the test
    cfg = {"name": "hf", "path": str(checkpoints["bin"])}
    for device in (torch.device("cuda", 1), torch.device("cpu")):
        with pytest.raises(InterruptedError):
            models.load(cfg, device, torch.float16)
    assert [(k["device_map"], k["dtype"]) for k in seen] == [(torch.device("cuda", 1), torch.float16),
                                                             (None, torch.float16)]


def test_a_sentencepiece_tokenizer_without_protobuf_says_what_to_install(checkpoints, monkeypatch):
    find_spec = models.importlib.util.find_spec
    monkeypatch.setattr(models.importlib.util, "find_spec",
                        lambda name: None if name == "google.protobuf" else find_spec(name))
    with pytest.raises(models.ModelUnavailable, match="needs protobuf: pip install sentencepiece protobuf"):
        models.load_tokenizer({"name": "hf", "path": str(checkpoints["bin"])})


def test_local_paths_and_hub_ids(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert models.hub_id("lmsys/vicuna-7b-v1.3") and models.hub_id("acme/model")
    for path in ("./acme/model", "/acme/model", "~/acme/model", "acme/model/v2", "tests/no-such-checkpoint"):
        assert not models.hub_id(path), path  # written as a path, or its first folder exists (tests/)
    (tmp_path / "acme").mkdir()
    assert not models.hub_id("acme/model")  # a folder beside which the checkpoint is missing
    with pytest.raises(models.ModelUnavailable) as err:
        models.weights_dir({"name": "hf", "path": "acme/model"})
    assert f"there is no folder {tmp_path}/acme/model nor {PROJECT_ROOT}/acme/model" in str(err.value)


def test_the_vicuna_default_is_a_local_folder_and_its_absence_says_what_to_do(tmp_path, monkeypatch):
    monkeypatch.delenv("VICUNA_7B_PATH", raising=False)
    path = config("model=vicuna-7b").model.path
    assert path == "./models/vicuna-7b-v1.3" and not models.hub_id(path)
    missing = tmp_path / "models" / "vicuna-7b-v1.3"
    monkeypatch.setenv("VICUNA_7B_PATH", str(missing))
    with pytest.raises(models.ModelUnavailable) as err:
        models.weights_dir(config("model=vicuna-7b").model)
    message = str(err.value)
    assert message.startswith(f"model.path={missing}: there is no folder {missing}. ")
    assert "model.path=/path/to/checkpoint" in message and "hub id (model.path=lmsys/vicuna-7b-v1.3)" in message
    (tmp_path / "models" / "vicuna-7b-v1.3").parent.mkdir()
    (tmp_path / "models" / "vicuna-7b-v1.3").write_text("")
    with pytest.raises(models.ModelUnavailable, match=f"{missing} is a file, not a folder"):
        models.weights_dir(config("model=vicuna-7b").model)



def test_a_missing_vicuna_is_one_clear_line(tmp_path):
    """From the command line too: the folder is named, never looked up on the hub (a hub id's message when the
    hub is out of reach: tests/test_models.py)."""
    missing = tmp_path / "models" / "vicuna-7b-v1.3"
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1", "VICUNA_7B_PATH": str(missing)}
    proc = subprocess.run([sys.executable, "-m", "evaluation.run", "model=vicuna-7b", "data.limit=1", "device=cpu"],
                          cwd=PROJECT_ROOT, env=env, capture_output=True, text=True)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    said = f"draftbench: error: model.path={missing}: there is no folder {missing}. "
    assert proc.stderr.startswith(said), proc.stderr
    assert "hub" not in proc.stderr.split("Point model.path")[0]
