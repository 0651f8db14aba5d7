"""EAGLE: the engine's hidden states, the head's incremental cache against a from-scratch head, lossless
static and dynamic trees on the tiny models, and the checkpoint loader's checks."""

from __future__ import annotations

import json
import random

import pytest
import torch
from safetensors.torch import save_file
from transformers import DynamicCache

from conftest import DEVICE, VOCAB, tiny_llama, tiny_qwen2, tiny_qwen3
from evaluation.build import build_drafter
from helpers import config
from methods.drafter import Drafter, Step
from methods.eagle import Eagle, EagleHead, HeadError, load_head
from methods.engine import Engine
from methods.tree import load_template
from methods.tree_search import TreePlan, fixed


def run(model, drafter: Drafter, prompt: list[int], n: int):
    return Engine(model, set()).generate(prompt, drafter, n)


class Recorder(Drafter):
    hidden_layers = (-1, 1)

    def __init__(self):
        super().__init__(VOCAB)
        self.prefill, self.steps = None, []

    def reset(self, prompt, prefill_logits, prefill_hidden=None):
        self.prefill = prefill_hidden

    def observe(self, step: Step) -> None:
        self.steps.append(step)


@torch.no_grad()
def test_the_engine_hands_over_the_requested_hidden_states(llama):
    recorder = Recorder()
    prompt = [5, 9, 2, 33, 7]
    gen = run(llama, recorder, prompt, 6)
    ids = prompt + gen.output_ids
    full = llama(torch.tensor([ids]), output_hidden_states=True)
    want = torch.cat([full.hidden_states[-1][0], full.hidden_states[1][0]], -1)  # the order asked for
    assert torch.allclose(recorder.prefill, want[: len(prompt)], atol=1e-5)
    for step in recorder.steps:  # the root at every step (no draft: the block is the root)
        assert torch.allclose(step.hidden_states[0], want[step.position], atol=1e-5)
    head = llama.get_output_embeddings()
    assert torch.allclose(head(recorder.prefill[:, :32]), full.logits[0, : len(prompt)], atol=1e-4)  # post-norm


@torch.no_grad()
def ranked_from_scratch(model, head: EagleHead, ids: list[int], path: list[int], k: int) -> list[int]:
    """The head's top-k after ``ids`` + ``path`` computed without a cache: target features for ``ids``,
    then the head's own predicted features for the drafted ``path`` tokens, as a drafter rolls them out."""
    feats = model(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0][:-1]
    tokens = list(ids[1:])
    embed, lm_head = model.get_input_embeddings(), model.get_output_embeddings()
    for token in [*path, None]:
        q = len(tokens)
        mask = torch.zeros(q, q).masked_fill_(~torch.ones(q, q, dtype=torch.bool).tril(), torch.finfo(torch.float32).min)
        out = head(embed(torch.tensor([tokens])), feats[None], torch.arange(q)[None], mask[None, None], DynamicCache())[0]
        feats, tokens = torch.cat([feats, out[-1:]]), tokens + [token]
    return lm_head(out[-1]).topk(k).indices.tolist()


@pytest.mark.parametrize("make", [tiny_llama, tiny_qwen2, tiny_qwen3])
def test_the_cached_head_drafts_what_a_head_from_scratch_predicts(make):
    model = make()
    drafter = Eagle(VOCAB, head="random", total_tokens=5, depth=4, top_k=1)  # top_k 1: a greedy chain
    prompt = [3, 14, 15, 9, 26, 5]
    gen = run(model, drafter, prompt, 9)  # the cache grows over prefill and several steps
    ids = prompt + gen.output_ids
    draft = drafter.propose(ids)  # from the cache built over prefill and steps
    chain: list[int] = []
    for _ in range(4):
        chain += ranked_from_scratch(model, drafter.head, ids, chain, 1)
    assert draft.shape.is_chain and draft.tokens.tolist() == chain


@pytest.mark.parametrize("kwargs", [{"total_tokens": 9, "depth": 3, "top_k": 2}, {"tree": "paper-b3"}],
                         ids=["dynamic", "static"])
def test_every_node_is_what_the_head_ranks_there_from_scratch(llama, kwargs):
    drafter = Eagle(VOCAB, head="random", **kwargs)
    prompt = [7, 1, 8, 2, 8]
    ids = prompt + run(llama, drafter, prompt, 5).output_ids
    draft = drafter.propose(ids)  # the tree's queries see the cached context, their ancestors and themselves
    tokens, shape = [ids[-1], *draft.tokens.tolist()], draft.shape
    for node, path in enumerate(shape.paths[1:], start=1):
        ranked = ranked_from_scratch(llama, drafter.head, ids, [tokens[i] for i in path[1:-1]], 3)
        if "tree" in kwargs:  # a template node is its parent's prediction of its rank, exactly
            assert tokens[node] == ranked[shape.sibling_ranks[node]], (node, path)
        else:
            assert tokens[node] in ranked[:2], (node, path)
    assert shape.n_nodes == (9 if "top_k" in kwargs else 8)


@pytest.mark.device
@pytest.mark.parametrize("model", ["llama", "gemma3"])
@pytest.mark.parametrize("kwargs", [{"total_tokens": 12, "depth": 4, "top_k": 3}, {"total_tokens": 2, "depth": 1, "top_k": 1},
                                    {"tree": "paper-b3"}, {"tree": "chain6"}],
                         ids=lambda k: "-".join(f"{a}={b}" for a, b in k.items()))
def test_output_equals_greedy_on_random_prompts(model, kwargs, request):
    net = request.getfixturevalue(model)
    rng = random.Random(f"eagle-{model}")
    drafter = Eagle(VOCAB, DEVICE, head="random", **kwargs)
    for _ in range(4):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 24))]
        n = rng.randint(1, 40)
        assert run(net, drafter, prompt, n).output_ids == run(net, Drafter(VOCAB), prompt, n).output_ids, prompt


@pytest.mark.device
def test_a_tree_plan_drafts_each_context_buckets_tree_and_nothing_where_it_has_none(llama):
    paths = load_template("paper-b3")
    plan = TreePlan(choices=(fixed(paths).choices[0], fixed([]).choices[0], fixed([[0], [0, 0]]).choices[0]),
                    bounds=(16, 30))
    drafter = Eagle(VOCAB, DEVICE, head="random", tree=plan)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    sizes = []
    original = drafter.propose
    drafter.propose = lambda ids: sizes.append((len(ids), original(ids))) or sizes[-1][1]
    assert run(llama, drafter, prompt, 40).output_ids == run(llama, Drafter(VOCAB), prompt, 40).output_ids
    for context, draft in sizes:
        expected = len(paths) if context < 16 else 0 if context < 30 else 2
        assert (0 if draft is None else len(draft.tokens)) == expected, context
    assert min(c for c, _ in sizes) < 16 and max(c for c, _ in sizes) >= 30  # every bucket was visited


def test_a_saved_head_loads_back_and_drafts_the_same(llama, tmp_path):
    torch.manual_seed(3)
    head = EagleHead(llama)
    head.save(tmp_path / "head", metrics={"top1": [0.5]})
    assert json.loads((tmp_path / "head" / "config.json").read_text())["num_hidden_layers"] == 1
    loaded = load_head(tmp_path / "head", llama)
    assert all(torch.equal(a, b) for a, b in zip(head.state_dict().values(), loaded.state_dict().values()))
    prompt = [4, 4, 2, 9]
    a = run(llama, Eagle(VOCAB, head=str(tmp_path / "head"), total_tokens=6, depth=2, top_k=2), prompt, 12)
    assert a.output_ids == run(llama, Drafter(VOCAB), prompt, 12).output_ids


def _published(llama, directory, drop=(), config_updates=None, rename=None, fmt="bin"):
    """A head in the published EAGLE-1 layout: a Llama config with one layer, fc.bias, pytorch_model.bin."""
    directory.mkdir()
    state = EagleHead(llama, fc_bias=True).state_dict()
    state = {(rename or {}).get(k, k): v for k, v in state.items() if k not in drop}
    state["embed_tokens.weight"] = llama.get_input_embeddings().weight.detach().clone()  # some heads ship it
    cfg = llama.config.to_dict() | {"num_hidden_layers": 1} | (config_updates or {})
    (directory / "config.json").write_text(json.dumps(cfg, default=str))
    if fmt == "bin":
        torch.save(state, directory / "pytorch_model.bin")
    else:
        save_file(state, str(directory / "model.safetensors"))
    return directory


def test_the_published_eagle1_layout_loads_with_its_fc_bias(llama, tmp_path):
    head = load_head(_published(llama, tmp_path / "vicuna-style"), llama)
    assert head.fc.bias is not None
    drafter = build_drafter(config("method=eagle", f"method.head={tmp_path / 'vicuna-style'}").method, VOCAB, "cpu")
    drafter.attach(llama)
    assert drafter.head.fc.bias is not None


@pytest.mark.parametrize("build, message", [
    (lambda m, d: _published(m, d, drop=("layers.0.mlp.up_proj.weight",)), r"missing \['layers.0.mlp.up_proj.weight'\]"),
    (lambda m, d: _published(m, d, config_updates={"hidden_size": 64}), "another target: hidden_size 64"),
    (lambda m, d: _published(m, d, config_updates={"vocab_size": 99}), "vocab_size 99"),
    (lambda m, d: _published(m, d, config_updates={"num_hidden_layers": 2}), "num_hidden_layers 2"),
    (lambda m, d: _published(m, d, rename={"fc.weight": "midlayer.fc.weight"}, fmt="st"), "EAGLE-3 head"),
    (lambda m, d: d, "no config.json"),
    (lambda m, d: (d.mkdir(), (d / "config.json").write_text("{}"))[0], "no model.safetensors or pytorch_model.bin"),
])
def test_a_wrong_or_misfit_head_is_refused_with_the_reason(llama, tmp_path, build, message):
    build(llama, tmp_path / "head")
    with pytest.raises(HeadError, match=message):
        Eagle(VOCAB, head=str(tmp_path / "head")).attach(llama)


def test_a_missing_head_or_bad_tree_is_refused():
    with pytest.raises(HeadError, match="method.head is not set"):
        Eagle(VOCAB)
    with pytest.raises(ValueError, match="total_tokens"):
        Eagle(VOCAB, head="random", total_tokens=1)


def test_through_the_harness_lossless_and_a_misfit_head_stops_before_any_question(tmp_path):
    from evaluation.run import run as run_config
    from helpers import tiny_checkpoint

    checkpoint = tiny_checkpoint(tmp_path / "ckpt")
    questions = tmp_path / "q.jsonl"
    questions.write_text("".join(json.dumps({"question_id": i, "category": "qa", "turns": ["a b c a b c " * (i + 1)]})
                                 + "\n" for i in range(3)))
    common = ["model=hf", f"model.path={checkpoint}", "model.template=plain", "max_new_tokens=16", "dtype=float32",
              "device=cpu", "threads=1", "run.progress=false", "warmup=0", f"data.path={questions}",
              f"run.dir={tmp_path / 'results'}"]
    paths = [run_config(config(*common, *method)) for method in
             (["method=baseline"], ["method=eagle", "method.head=random", "method.total_tokens=8", "method.depth=3",
                                    "method.top_k=2"])]
    outputs = [[json.loads(line)["choices"][0]["output_ids"] for line in p.read_text().splitlines()] for p in paths]
    assert outputs[0] == outputs[1] and len(outputs[0]) == 3

    head = EagleHead(tiny_llama())  # hidden 32 and a 64-token vocabulary: not the checkpoint's 30 tokens
    head.save(tmp_path / "other")
    with pytest.raises(HeadError, match="another target: vocab_size 64"):
        run_config(config(*common, "method=eagle", f"method.head={tmp_path / 'other'}", "method.label=misfit"))
    assert not list((tmp_path / "results").rglob("misfit*.jsonl"))
