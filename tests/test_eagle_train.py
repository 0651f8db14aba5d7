"""EAGLE head training (evaluation/train_eagle.py): the data pass against teacher forcing, shards, prompts,
the chain accuracy against drafting from scratch, a resumed training equal to an uninterrupted one, and
the draft vocabulary's drafting (lossless, and the same drafts as the full vocabulary when it is all of it)."""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import VOCAB
from helpers import config, tiny_checkpoint
from methods.drafter import Drafter
from methods.eagle import Eagle, EagleHead, HeadError
from evaluation import train_eagle as training
from methods.eagle.data import Example, generate_batch, read_shards, write_shard
from methods.eagle.head import DRAFT_VOCAB_FILE
from methods.eagle.prompts import drop_overlap, training_prompts
from methods.engine import Engine
from test_eagle import ranked_from_scratch


def greedy(model, prompt: list[int], n: int) -> list[int]:
    return Engine(model, set()).generate(prompt, Drafter(VOCAB), n).output_ids


@torch.no_grad()
def test_the_data_pass_is_greedy_and_its_features_are_teacher_forced(llama):
    prompts = [[5, 9, 2, 33, 7], [1], [8, 8, 3, 60, 2, 2, 41, 17, 9]]  # left padding of different widths
    results = generate_batch(llama, prompts, 12, eos={63}, pad=0)
    for prompt, (answer, features) in zip(prompts, results):
        want = greedy(llama, prompt, 12)
        stop = want.index(63) + 1 if 63 in want else len(want)
        assert answer == want[:stop]
        ids = prompt + answer
        full = llama(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]
        assert features.dtype == torch.float16 and features.shape == (len(ids) - 1, 32)
        torch.testing.assert_close(features.float(), full[:-1], atol=2e-3, rtol=2e-3)


def test_shards_round_trip(tmp_path):
    examples = [Example(index=i, tokens=torch.randint(0, VOCAB, (n,)), features=torch.randn(n - 1, 8).half(),
                        start=s) for i, (n, s) in enumerate([(5, 2), (1, 1), (9, 4)])]
    write_shard(tmp_path / "shard-00000.safetensors", examples[:2])
    write_shard(tmp_path / "shard-00001.safetensors", examples[2:])
    back = list(read_shards(tmp_path))
    assert [(e.index, e.start) for e in back] == [(e.index, e.start) for e in examples]
    for a, b in zip(back, examples):
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.features, b.features)
    assert not list(tmp_path.glob("*.tmp"))


def test_prompts_are_seeded_and_those_overlapping_an_evaluation_set_are_dropped():
    pairs = training_prompts(0, ["templates"], 40)
    assert pairs == training_prompts(0, ["templates"], 40) and pairs != training_prompts(1, ["templates"], 40)
    assert {s for s, _ in pairs} == {"templates"} and len({p for _, p in pairs}) == len(pairs)
    victim = pairs[3][1]
    words = victim.split()
    evaluation = ["Some preamble: " + " ".join(words[:8]) + " and then other words"]
    kept, dropped = drop_overlap(pairs, evaluation, 8)
    assert victim not in [p for _, p in kept] and dropped >= 1
    assert drop_overlap(pairs, ["nothing in common here at all, not one run of eight words"], 8) == (pairs, 0)
    with pytest.raises(ValueError, match="known: "):
        training_prompts(0, ["nonsense"], 1)


def _examples(model, count: int, seed: int, answer: int = 12) -> list[Example]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randint(2, 8))] for _ in range(count)]
    return [Example(index=i, tokens=torch.tensor(p + a), features=f, start=len(p))
            for i, (p, (a, f)) in enumerate(zip(prompts, generate_batch(model, prompts, answer, set(), 0)))]


@torch.no_grad()
def test_the_chain_accuracy_is_what_drafting_from_scratch_gets_right(llama):
    torch.manual_seed(0)
    examples = _examples(llama, 6, seed=1)
    embed, rows = llama.get_input_embeddings(), llama.get_output_embeddings().weight.detach()
    ids = torch.arange(VOCAB)
    head = EagleHead(llama)
    optimizer = torch.optim.AdamW(head.parameters(), lr=1e-2)
    with torch.enable_grad():  # fitted to these answers, so that chains are right several tokens deep
        for _ in range(60):
            loss, _ = training.head_loss(head, embed, rows, training._batch(examples, torch.float32), 0.0, 1.0, None)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    head.eval()
    accuracy = training.chain_accuracy(head, embed, rows, ids, examples, 3)
    hits, total = [0, 0, 0], 0
    for e in examples:
        tokens = e.tokens.tolist()
        for t in range(max(e.start - 1, 0), len(tokens) - 2):  # chains guessing tokens t + 2 ...
            chain: list[int] = []
            for d in range(3):
                if t + d + 2 >= len(tokens):
                    break
                guess = ranked_from_scratch(llama, head, tokens[: t + 2], chain, 1)[0]
                if guess != tokens[t + d + 2]:
                    break
                hits[d] += 1
                chain.append(guess)
            total += 1
    assert accuracy == [h / total for h in hits]
    assert hits[2] > 0  # the check reaches the last depth
    # a draft vocabulary without the right tokens gets nothing right
    wrong = torch.tensor(sorted(set(range(VOCAB)) - {int(t) for e in examples for t in e.tokens}))
    assert training.chain_accuracy(head, embed, rows[wrong], wrong, examples, 3) == [0.0, 0.0, 0.0]


def _train_config(tmp_path, work, out, *extra):
    checkpoint = tmp_path / "ckpt"
    if not checkpoint.exists():
        tiny_checkpoint(checkpoint)
    return config("model=hf", f"model.path={checkpoint}", "model.template=plain", "threads=1",
                  f"train.work_dir={work}", f"train.out={out}", "train.sources=[templates]", "train.templates=40",
                  "train.exclude=[]", "train.max_new_tokens=10", "train.gen_batch=16", "train.heldout_every=5",
                  "train.epochs=2", "train.batch_tokens=64", "train.checkpoint_steps=1", "train.eval_examples=4",
                  "train.eval_depth=3", "train.draft_vocab=20", *extra, name="train_eagle")


class Interrupted(Exception):
    pass


def test_training_resumes_to_the_same_head_and_the_head_drafts_losslessly(tmp_path, monkeypatch):
    out = training.run(_train_config(tmp_path, tmp_path / "a", tmp_path / "head-a"))
    metrics = json.loads((out / "metrics.json").read_text())
    assert len(metrics["epochs"]) == 2 and metrics["draft_vocab"] == 20 and set(metrics["sources"]) == {"templates"}
    assert len(metrics["heldout_chain_accuracy_float16_weights"]) == 3 and metrics["heldout_examples"] == 8

    # the same run, interrupted after five optimizer steps and run again: the same head, to the bit
    work = tmp_path / "b"
    work.mkdir()
    shutil.copytree(tmp_path / "a" / "data", work / "data")
    shutil.copy(tmp_path / "a" / "prompts.json", work)
    calls = {"n": 0, "stop": 6}
    loss = training.head_loss

    def interrupting(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == calls["stop"]:
            raise Interrupted
        return loss(*args, **kwargs)

    monkeypatch.setattr(training, "head_loss", interrupting)
    with pytest.raises(Interrupted):
        training.run(_train_config(tmp_path, work, tmp_path / "head-b"))
    calls.update(n=0, stop=-1)
    resumed = training.run(_train_config(tmp_path, work, tmp_path / "head-b"))
    assert calls["n"] == 2 * 14 - 5  # two epochs of 14 batches, the first five done before the interruption
    first, second = load_file(str(out / "model.safetensors")), load_file(str(resumed / "model.safetensors"))
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)
    again = json.loads((resumed / "metrics.json").read_text())
    assert [{**e, "seconds": 0} for e in again["epochs"]] == [{**e, "seconds": 0} for e in metrics["epochs"]]
    assert len(load_file(str(out / DRAFT_VOCAB_FILE))["tokens"]) == 20

    # the trained head through the harness: lossless, drafting over its 20 tokens
    from evaluation.run import run as run_config

    questions = tmp_path / "q.jsonl"
    questions.write_text("".join(json.dumps({"question_id": i, "category": "qa", "turns": ["a b c a b c " * (i + 1)]})
                                 + "\n" for i in range(3)))
    common = ["model=hf", f"model.path={tmp_path / 'ckpt'}", "model.template=plain", "max_new_tokens=16",
              "dtype=float32", "device=cpu", "threads=1", "run.progress=false", "warmup=0", f"data.path={questions}",
              f"run.dir={tmp_path / 'results'}"]
    paths = [run_config(config(*common, *method)) for method in
             (["method=baseline"], ["method=eagle", f"method.head={out}", "method.total_tokens=8", "method.depth=3",
                                    "method.top_k=2"])]
    outputs = [[json.loads(line)["choices"][0]["output_ids"] for line in p.read_text().splitlines()] for p in paths]
    assert outputs[0] == outputs[1] and len(outputs[0]) == 3
    meta = json.loads(paths[1].with_name(paths[1].name.removesuffix(".jsonl") + ".meta.json").read_text())
    assert meta["drafter"]["draft_vocab"] == 20


def _saved_head(llama, directory, tokens=None):
    torch.manual_seed(5)
    EagleHead(llama).save(directory, draft_vocab=tokens)
    return str(directory)


@pytest.mark.parametrize("kwargs", [{"total_tokens": 10, "depth": 3, "top_k": 3}, {"tree": "paper-b3"}],
                         ids=["dynamic", "static"])
def test_a_draft_vocabulary_drafts_only_its_tokens_losslessly(llama, tmp_path, kwargs):
    prompt = [3, 9, 27, 5, 5, 12]
    full = Eagle(VOCAB, head=_saved_head(llama, tmp_path / "plain"), **kwargs)
    # the whole vocabulary in another order: the same drafts, so draft ids map back to target ids
    shuffled = Eagle(VOCAB, head=_saved_head(llama, tmp_path / "shuffled", torch.randperm(VOCAB)), **kwargs)
    some = torch.tensor(random.Random(0).sample(range(VOCAB), 16))
    small = Eagle(VOCAB, head=_saved_head(llama, tmp_path / "small", some), **kwargs)
    want = greedy(llama, prompt, 20)
    for drafter in (full, shuffled, small):
        assert Engine(llama, set()).generate(prompt, drafter, 20).output_ids == want
    ids = prompt + want
    a, b, c = (d.propose(ids) for d in (full, shuffled, small))
    assert torch.equal(a.tokens, b.tokens) and a.shape.parents == b.shape.parents
    assert set(c.tokens.tolist()) <= set(some.tolist())
    assert full.describe()["draft_vocab"] == VOCAB and small.describe()["draft_vocab"] == 16
    first8 = Eagle(VOCAB, head=str(tmp_path / "small"), draft_vocab=8, **kwargs)
    assert Engine(llama, set()).generate(prompt, first8, 20).output_ids == want
    assert set(first8.propose(ids).tokens.tolist()) <= set(some[:8].tolist())
    unused = Eagle(VOCAB, head=str(tmp_path / "small"), draft_vocab=False, **kwargs)
    unused.attach(llama)
    assert unused.describe()["draft_vocab"] == VOCAB


def test_a_bad_draft_vocabulary_is_refused_with_the_reason(llama, tmp_path):
    head = _saved_head(llama, tmp_path / "head", torch.arange(10))
    with pytest.raises(HeadError, match="ships 10 draft tokens"):
        Eagle(VOCAB, head=head, draft_vocab=11).attach(llama)
    with pytest.raises(HeadError, match="ships no draft_vocab"):
        Eagle(VOCAB, head=_saved_head(llama, tmp_path / "none"), draft_vocab=4).attach(llama)
    with pytest.raises(HeadError, match="random head has no draft vocabulary"):
        Eagle(VOCAB, head="random", draft_vocab=4).attach(llama)
    with pytest.raises(ValueError, match="positive count"):
        Eagle(VOCAB, head=head, draft_vocab=0)
    save_file({"tokens": torch.tensor([1, VOCAB], dtype=torch.int32)}, str(tmp_path / "head" / DRAFT_VOCAB_FILE))
    with pytest.raises(HeadError, match="target ids below 64"):
        Eagle(VOCAB, head=head).attach(llama)
