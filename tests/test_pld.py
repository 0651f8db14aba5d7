"""Prompt Lookup Decoding: the n-gram lookup on toy token lists, and greedy equality on the tiny models."""

import random

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from conftest import DEVICE, VOCAB
from evaluation.build import build_drafter
from helpers import config
from methods.drafter import Drafter
from methods.engine import Engine
from methods.pld import NgramIndex, PromptLookup


def naive(ids: list[int], min_n: int, max_n: int, length: int) -> list[int]:
    """The definition, by brute force: scan back for the suffix, then copy through ``ids + draft``."""
    for n in range(max_n, min_n - 1, -1):
        if n >= len(ids):
            continue
        for end in range(len(ids) - 2, n - 2, -1):
            if ids[end - n + 1 : end + 1] == ids[-n:]:
                out = list(ids)
                for k in range(length):
                    out.append(out[end + 1 + k])
                return out[len(ids) :]
    return []


def lookup(ids: list[int], min_n: int = 1, max_n: int = 3, length: int = 4) -> list[int]:
    index = NgramIndex(min_n, max_n)
    return index.continuation(ids, length)


@pytest.mark.parametrize(
    "ids, kwargs, expected",
    [
        ([1, 2, 3, 4, 5, 1, 2, 3], {}, [4, 5, 1, 2]),  # the 3-gram [1 2 3] matched, copied
        ([1, 2, 5, 1, 2, 6, 1, 2], {}, [6, 1, 2, 6]),  # the most recent [1 2], then through the draft itself
        ([7, 1, 2, 9, 3, 1, 2, 8, 7, 1, 2], {}, [9, 3, 1, 2]),  # the longest suffix wins over a more recent shorter one
        ([4, 1, 2, 9, 5, 1, 2], {}, [9, 5, 1, 2]),  # no earlier [5 1 2]: falls back to [1 2]
        ([3, 9, 8, 7, 3], {}, [9, 8, 7, 3]),  # down to a 1-gram
        ([3, 9, 8, 7, 3], {"min_n": 2}, []),  # ... unless min_ngram_size forbids it
        ([5, 5], {}, [5, 5, 5, 5]),  # an overlapping match: a run continues
        ([1, 2, 3], {}, []),  # nothing repeats
        ([1, 2, 1, 2, 3, 1, 2], {"length": 2}, [3, 1]),  # length caps the copy
        ([9], {}, []),  # the root alone
    ],
)
def test_continuation(ids, kwargs, expected):
    assert lookup(ids, **kwargs) == expected == naive(ids, kwargs.get("min_n", 1), 3, kwargs.get("length", 4))


@given(
    st.lists(st.integers(0, 3), min_size=1, max_size=12),
    st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=4), max_size=6),
    st.integers(1, 3),
    st.integers(0, 2),
    st.integers(1, 5),
)
def test_incremental_index_matches_brute_force(prompt, chunks, min_n, extra, length):
    """Indexing as the context grows (the prompt at reset, then each step's tokens) == rescanning everything."""
    index = NgramIndex(min_n, min_n + extra)
    index.extend(prompt, len(prompt))
    ids = list(prompt)
    for chunk in chunks:
        ids += chunk
        assert index.continuation(ids, length) == naive(ids, min_n, min_n + extra, length)


def test_reset_rebuilds_the_index_from_the_new_prompt():
    drafter = PromptLookup(VOCAB)
    drafter.reset(torch.tensor([1, 2, 3]), None)
    assert drafter.propose([1, 2, 3, 1]).tokens.tolist() == [2, 3, 1, 2, 3, 1, 2, 3, 1, 2]
    drafter.reset(torch.tensor([4, 5]), None)
    assert drafter.propose([4, 5, 1]) is None  # nothing of the previous prompt survives


@pytest.mark.parametrize("kwargs", [{"min_ngram_size": 0}, {"min_ngram_size": 3, "max_ngram_size": 2},
                                    {"num_pred_tokens": 0}])
def test_bad_parameters_are_refused(kwargs):
    with pytest.raises(ValueError, match="ngram_size|num_pred_tokens"):
        PromptLookup(VOCAB, **kwargs)


def test_config_label_and_overrides():
    cfg = config("method=pld", "method.max_ngram_size=4", "method.num_pred_tokens=5")
    assert cfg.method.label == "pld-n1-4-k5"
    drafter = build_drafter(cfg.method, vocab_size=VOCAB, device="cpu")
    assert [len(t) for t in drafter.plan.trees] == [5] and list(drafter.index.sizes) == [4, 3, 2, 1]


@pytest.mark.device
@pytest.mark.parametrize("model", ["llama", "gemma3"])  # gemma3: sliding window 8, crossed by every context here
@pytest.mark.parametrize("kwargs", [{}, {"max_ngram_size": 2, "num_pred_tokens": 4}, {"min_ngram_size": 2}])
def test_output_equals_greedy_on_random_prompts(model, kwargs, request):
    engine = Engine(request.getfixturevalue(model), set())
    rng = random.Random(f"pld-{model}")
    for _ in range(4):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 24))]
        n = rng.randint(1, 48)
        assert engine.generate(prompt, PromptLookup(VOCAB, DEVICE, **kwargs), n).output_ids == \
            engine.generate(prompt, Drafter(VOCAB), n).output_ids, prompt


@pytest.mark.device
def test_drafts_are_accepted_on_a_repetitive_prompt(llama):
    prompt = [3, 17, 42, 8, 3, 17, 42, 8, 3, 17]
    engine = Engine(llama, set())
    gen = engine.generate(prompt, PromptLookup(VOCAB, DEVICE), 48)
    assert gen.output_ids == engine.generate(prompt, Drafter(VOCAB), 48).output_ids
    mat = sum(gen.accept_lengths) / len(gen.accept_lengths)
    assert mat > 1.5, f"PLD should copy the repeating continuation (MAT {mat:.2f})"
