"""The verification engine is lossless: whatever is drafted, the output is greedy decoding's."""

import os
import random
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import DEVICE, VOCAB, tiny_gemma3, tiny_llama, tiny_qwen2, tiny_qwen3
from evaluation import models
from methods.drafter import Drafter, Step
from methods.engine import Engine, Padding, PromptTooLong
from methods.tree import Draft, TreeShape

pytestmark = pytest.mark.device  # every model and draft on conftest.DEVICE

MODELS = {"llama": tiny_llama(), "gemma3": tiny_gemma3(sliding_window=8),  # contexts below cross the window
          "qwen2": tiny_qwen2(), "qwen3": tiny_qwen3()}


def greedy(model, prompt: list[int], n: int) -> list[int]:
    """Reference: transformers' own greedy generate, token by token."""
    prompt_ids = torch.tensor([prompt], device=model.device)
    out = model.generate(prompt_ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


class RandomTrees(Drafter):
    """Random tree shapes each step; each node is the true continuation with probability ``hit``
    (knowing the reference), so deep and branching paths get accepted, non-contiguously."""

    def __init__(self, reference: list[int], prompt_len: int, seed: int, hit: float = 0.6, extras: bool = False):
        super().__init__(VOCAB)
        self.reference, self.prompt_len, self.extras = reference, prompt_len, extras
        self.rng, self.hit = random.Random(seed), hit
        self.steps: list[Step] = []

    def propose(self, ids):
        done = len(ids) - self.prompt_len
        n = self.rng.randrange(0, 12)
        parents, tokens, depth = [], [], [0]
        for i in range(1, n + 1):
            p = self.rng.randrange(0, i)
            parents.append(p)
            depth.append(depth[p] + 1)
            truth = self.reference[done + depth[i] - 1] if done + depth[i] - 1 < len(self.reference) else 0
            tokens.append(truth if self.rng.random() < self.hit else self.rng.randrange(VOCAB))
        m = self.rng.randrange(0, 4) if self.extras else 0
        extra_depths = tuple(self.rng.randrange(1, 5) for _ in range(m))
        size = n + 1 + m
        extra_visible = tuple(tuple(sorted(self.rng.sample(range(size), self.rng.randrange(0, size)))) for _ in range(m))
        tokens += [self.rng.randrange(VOCAB) for _ in range(m)]
        return Draft(torch.tensor(tokens, dtype=torch.long, device=DEVICE),
                     TreeShape(tuple(parents), extra_depths, extra_visible))

    def observe(self, step):
        self.steps.append(step)


class Oracle(Drafter):
    """Proposes the true continuation as a chain of ``depth`` (or, with ``wrong``, a guaranteed miss)."""

    def __init__(self, reference: list[int], prompt_len: int, depth: int, wrong: bool = False, branch: bool = False):
        super().__init__(VOCAB)
        self.reference, self.prompt_len, self.depth, self.wrong, self.branch = reference, prompt_len, depth, wrong, branch

    def propose(self, ids):
        done = len(ids) - self.prompt_len
        chain = self.reference[done : done + self.depth]
        if self.wrong:
            chain = [(t + 1) % VOCAB for t in chain]
        if not chain:
            return None
        if self.branch:  # a decoy sibling before every true node: the accepted path is not 1..L
            parents, tokens, prev = [], [], 0
            for t in chain:
                parents += [prev, prev]
                tokens += [(t + 1) % VOCAB, t]
                prev = len(tokens)
            return Draft(torch.tensor(tokens, device=DEVICE), TreeShape(tuple(parents)))
        return Draft(torch.tensor(chain, device=DEVICE), TreeShape(tuple(range(len(chain)))))


prompts = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12)


@pytest.mark.parametrize("name", MODELS)
def test_baseline_equals_transformers_generate(name):
    model = MODELS[name]
    prompt = [5, 9, 2, 33, 7]
    gen = Engine(model, set()).generate(prompt, Drafter(VOCAB), 30)
    assert gen.output_ids == greedy(model, prompt, 30)
    assert gen.accept_lengths == [1] * 29


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("masked_gqa", ["1", "0"])  # SDPA over the key/value heads under a mask (CPU) or not (CUDA)
@settings(max_examples=12, deadline=None)
@given(prompt=prompts, seed=st.integers(0, 2**16), extras=st.booleans())
def test_random_trees_are_lossless(name, masked_gqa, prompt, seed, extras):
    model = MODELS[name]
    with mock.patch.dict(os.environ, {models.MASKED_GQA: masked_gqa}):
        reference = greedy(model, prompt, 24)
        drafter = RandomTrees(reference, len(prompt), seed, extras=extras)
        gen = Engine(model, set()).generate(prompt, drafter, 24)
    assert gen.output_ids == reference
    assert sum(gen.accept_lengths) == 23 and min(gen.accept_lengths) >= 1


def padding_by_context() -> Padding:
    """Below context 10 every block of 2.. tokens is fed as a multiple of 4; above, 3 extra tokens each."""
    near = tuple([0, 1] + [q + (-q) % 4 for q in range(2, 40)])
    far = tuple([0, 1] + [q + 3 for q in range(2, 40)])
    return Padding(bounds=(10,), sizes=(near, far))


@pytest.mark.parametrize("name", MODELS)
@settings(max_examples=8, deadline=None)
@given(prompt=prompts, seed=st.integers(0, 2**16), extras=st.booleans())
def test_padded_blocks_are_lossless_and_invisible_to_the_drafter(name, prompt, seed, extras):
    model = MODELS[name]
    reference = greedy(model, prompt, 24)
    plain, padded = (RandomTrees(reference, len(prompt), seed, extras=extras) for _ in range(2))
    want = Engine(model, set()).generate(prompt, plain, 24)
    padding = padding_by_context()
    gen = Engine(model, set(), padding=padding).generate(prompt, padded, 24)
    assert gen.output_ids == want.output_ids == reference
    assert gen.accept_lengths == want.accept_lengths
    for a, b, fed in zip(plain.steps, padded.steps, gen.block_sizes):
        assert (b.shape.parents, b.shape.extra_depths) == (a.shape.parents, a.shape.extra_depths)
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.accepted, b.accepted)
        assert b.logits.shape == a.logits.shape
        torch.testing.assert_close(b.logits, a.logits, rtol=1e-4, atol=1e-4)
        assert fed == padding.size(a.shape.size, a.position) >= a.shape.size


def test_padding_refuses_to_shrink_a_block():
    with pytest.raises(ValueError, match="only add tokens"):
        Padding(bounds=(), sizes=((0, 1, 2, 2),))
    with pytest.raises(ValueError, match="single token"):
        Padding(bounds=(), sizes=((0, 4, 4),))
    assert Padding(bounds=(), sizes=((0, 1, 4, 4, 4),)).size(9, 100) == 9  # past the table: as it is


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("branch", [False, True])
def test_oracle_is_accepted_whole(name, branch):
    model = MODELS[name]
    prompt = [1, 2, 3, 4, 5, 6]
    reference = greedy(model, prompt, 40)
    gen = Engine(model, set()).generate(prompt, Oracle(reference, len(prompt), depth=4, branch=branch), 40)
    assert gen.output_ids == reference
    assert gen.accept_lengths[:-1] == [5] * (len(gen.accept_lengths) - 1)  # depth + bonus; the last is cut at 40
    assert sum(gen.accept_lengths) == 39


@pytest.mark.parametrize("name", MODELS)
def test_garbage_drafts_change_nothing(name):
    model = MODELS[name]
    prompt = [7, 7, 1, 30]
    reference = greedy(model, prompt, 20)
    gen = Engine(model, set()).generate(prompt, Oracle(reference, len(prompt), depth=5, wrong=True), 20)
    assert gen.output_ids == reference
    assert gen.accept_lengths == [1] * 19


@pytest.mark.parametrize("depth", [0, 6])
def test_stops_exactly_at_eos(depth):
    model = MODELS["llama"]
    prompt = [3, 1, 4, 1, 5]
    reference = greedy(model, prompt, 30)
    eos = reference[9]
    first = reference.index(eos)
    gen = Engine(model, {eos}).generate(prompt, Oracle(reference, len(prompt), depth=depth), 30)
    assert gen.output_ids == reference[: first + 1]  # EOS kept, nothing after it
    assert 1 + sum(gen.accept_lengths) == len(gen.output_ids)


def test_max_new_tokens_truncates_an_accepted_path():
    model = MODELS["llama"]
    prompt = [2, 7, 1, 8]
    reference = greedy(model, prompt, 12)
    gen = Engine(model, set()).generate(prompt, Oracle(reference, len(prompt), depth=6), 12)
    assert gen.output_ids == reference[:12]
    assert gen.accept_lengths == [7, 4]


def test_step_reports_accepted_path_and_logits():
    model = MODELS["llama"]
    prompt = [9, 8, 7]
    reference = greedy(model, prompt, 10)
    drafter = RandomTrees(reference, len(prompt), seed=3, hit=0.9, extras=True)
    Engine(model, set()).generate(prompt, drafter, 10)
    for step in drafter.steps:
        assert step.logits.shape == (step.shape.size, VOCAB)
        assert step.accepted[0] == 0 and list(step.shape.paths[int(step.accepted[-1])]) == step.accepted.tolist()
        accepted_tokens = step.tokens[step.accepted[1:]].tolist()
        assert step.emitted[: len(accepted_tokens)] == accepted_tokens


def test_a_prompt_that_fills_the_context_is_a_clear_error():
    with pytest.raises(PromptTooLong, match="a prompt of 512 tokens leaves no room for an answer within the model's "
                                            "context of 512 tokens"):
        Engine(MODELS["llama"], set()).generate([1] * 512, Drafter(VOCAB), 20)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("seed", range(3))
def test_an_answer_ends_at_the_context_by_the_same_rule_for_every_drafter(name, seed):
    """Spec-Bench's long prompts: the answer stops where prompt + answer fill the model's 512 positions, whatever
    was drafted beyond them (draft nodes past the context are verified at clamped positions, never emitted)."""
    model = MODELS[name]
    prompt = [random.Random(seed).randrange(VOCAB) for _ in range(500)]
    base = Engine(model, set()).generate(prompt, Drafter(VOCAB), 20)
    assert len(base.output_ids) == 12 and base.end == "context"
    reference = base.output_ids + [0] * 20
    gen = Engine(model, set()).generate(prompt, RandomTrees(reference, len(prompt), seed, hit=0.8, extras=True), 20)
    assert gen.output_ids == base.output_ids and gen.end == "context"
    short = Engine(model, set()).generate(prompt[:100], Drafter(VOCAB), 20)
    assert len(short.output_ids) == 20 and short.end == "budget"


def test_max_new_tokens_must_be_positive():
    with pytest.raises(ValueError, match="positive"):
        Engine(MODELS["llama"], set()).generate([1, 2], Drafter(VOCAB), 0)
