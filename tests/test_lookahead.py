"""Lookahead decoding: the n-gram pool, the window's trajectories and moves, the block layout, greedy equality."""

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
from methods.lookahead import Lookahead, NgramPool, advance, block_shape, trajectories


@pytest.mark.parametrize(
    "adds, expected",
    [
        ([(1, (2, 3)), (1, (4, 5))], [(2, 3), (4, 5)]),  # oldest first
        ([(1, (2, 3)), (1, (4, 5)), (1, (2, 3))], [(4, 5), (2, 3)]),  # a repeat becomes the most recent
        ([(1, (2, 3)), (1, (4, 5)), (1, (6, 7))], [(4, 5), (6, 7)]),  # over capacity: the oldest goes
        ([(1, (2, 3)), (9, (4, 5)), (9, (6, 7)), (9, (8, 9))], [(2, 3)]),  # keys are independent
        ([], []),
    ],
)
def test_pool(adds, expected):
    pool = NgramPool(capacity=2)
    for key, ngram in adds:
        pool.add(key, ngram)
    assert pool.get(1) == expected


def reference_add(token_map: dict[int, list], key: int, ngram: tuple, capacity: int) -> None:
    """The reference's token_map update, literally: a repeat moves to the back, else append, else drop the first."""
    entries = token_map.setdefault(key, [])
    if ngram in entries:
        entries.remove(ngram)
        entries.append(ngram)
    elif len(entries) < capacity:
        entries.append(ngram)
    else:
        token_map[key] = entries[1:] + [ngram]


@given(st.lists(st.tuples(st.integers(0, 2), st.tuples(st.integers(0, 2), st.integers(0, 2))), max_size=30),
       st.integers(1, 4))
def test_pool_matches_the_reference_list_update(adds, capacity):
    """The reference's token_map update (remove + append, else append, else drop the first), literally."""
    reference: dict[int, list] = {}
    pool = NgramPool(capacity)
    for key, ngram in adds:
        reference_add(reference, key, ngram, capacity)
        pool.add(key, ngram)
    assert all(pool.get(key) == entries for key, entries in reference.items())


def test_prompt_seeding_adds_every_ngram_in_order():
    pool = NgramPool(capacity=7)
    pool.add_sequence([1, 2, 3, 1, 2, 4, 5], n=3)
    assert (pool.get(1), pool.get(2), pool.get(4), pool.get(5)) == ([(2, 3), (2, 4)], [(3, 1), (4, 5)], [], [])


# A steady window for N=4, W=3 behind root 9: rows[0] excludes the root; `last` = the last row's argmaxes.
ROWS, LAST = [[1, 2], [3, 4, 5], [6, 7, 8]], [10, 11, 12]


def test_trajectories_read_each_column_down():
    assert trajectories(9, ROWS, LAST) == [(9, (3, 6, 10)), (1, (4, 7, 11)), (2, (5, 8, 12))]


@pytest.mark.parametrize(
    "skip, expected",
    [
        (0, [[4, 5], [6, 7, 8], [10, 11, 12]]),  # up one row, left one column (ALWAYS_FWD_ONE)
        (1, [[5, 0], [7, 8, 0], [11, 12, 0]]),  # one accepted draft: one more column, padded
        (3, [[0, 0], [0, 0, 0], [0, 0, 0]]),  # more than the window holds
    ],
)
def test_advance(skip, expected):
    assert advance(ROWS, LAST, skip, lambda n: [0] * n) == expected


def test_block_layout_by_hand():
    # 2 chains of 2 (BFS: 1 2 | 3 4), then the 2x3 window minus its root: (0,1)=5 (0,2)=6 (1,0)=7 (1,1)=8 (1,2)=9
    shape = block_shape(rows=2, cols=3, guesses=2, guess_len=2)
    assert shape.parents == (0, 0, 1, 2)
    assert shape.extra_depths == (1, 2, 1, 2, 3)
    assert shape.extra_visible == ((0,), (0, 5), (0,), (0, 5), (0, 5, 6))
    assert block_shape(rows=2, cols=3, guesses=2, guess_len=2) is shape  # built once


@pytest.mark.parametrize("rows, cols, guesses", [(1, 9, 0), (3, 7, 0), (4, 7, 7), (2, 1, 3)])
def test_every_window_token_sees_exactly_its_trajectory(rows, cols, guesses):
    """One visible token per smaller depth, all in the window's row 0 or the token's own column, no candidate."""
    shape = block_shape(rows, cols, guesses, guess_len=4)
    n1 = shape.n_nodes
    assert n1 == 1 + 4 * guesses and shape.size == n1 + rows * cols - 1
    for j, (depth, seen) in enumerate(zip(shape.extra_depths, shape.extra_visible)):
        assert sorted(shape.depth_list[k] for k in seen) == list(range(depth))
        assert all(k == 0 or k >= n1 for k in seen) and n1 + j not in seen


def test_window_starts_from_the_prompt_deterministically_and_fills_up(llama):
    drafter = Lookahead(VOCAB, N=4, W=3, G=2, seed=5)
    prompt = torch.tensor([11, 12, 13, 14, 15])
    drafter.reset(prompt, None)
    first = drafter.propose([11, 12, 13, 14, 15, 16])
    assert first.shape is block_shape(1, 1 + 3 + 4 - 3, 0, 3)  # W+N-3 guesses behind the root, no candidate yet
    assert set(first.tokens.tolist()) <= set(prompt.tolist())
    drafter.reset(prompt, None)
    assert drafter.propose([16]).tokens.tolist() == first.tokens.tolist()  # reseeded every generation
    Engine(llama, set()).generate(prompt.tolist(), drafter, 4)  # N-2 = 2 warm-up steps and one more
    assert [len(row) for row in drafter.rows] == [2, 3, 3]  # N-1 rows of W (row 0 behind the root)


@pytest.mark.parametrize("kwargs", [{"N": 2}, {"W": 0}, {"G": 0}, {"shift": "two"}])
def test_bad_parameters_are_refused(kwargs):
    with pytest.raises(ValueError, match="method"):
        Lookahead(VOCAB, **kwargs)


def test_config_label_and_overrides():
    cfg = config("method=lookahead", "method.N=4", "method.W=5", "method.G=3", "method.shift=accepted")
    assert cfg.method.label == "lookahead-N4-W5-G3-accepted-promptFalse"
    drafter = build_drafter(cfg.method, vocab_size=VOCAB, device="cpu")
    assert (drafter.N, drafter.W, drafter.G, drafter.shift, drafter.seed) == (4, 5, 3, "accepted", cfg.seed)


CONFIGS = [{}, {"shift": "accepted", "seed_prompt": True}, {"N": 3, "W": 2, "G": 2}]


@pytest.mark.device
@pytest.mark.parametrize("model", ["llama", "gemma3"])  # gemma3: sliding window 8, crossed by every context here
@pytest.mark.parametrize("kwargs", CONFIGS)
def test_output_equals_greedy_on_random_prompts(model, kwargs, request):
    engine = Engine(request.getfixturevalue(model), set())
    rng = random.Random(f"lookahead-{model}")
    drafter = Lookahead(VOCAB, DEVICE, **kwargs)  # one drafter for all prompts: reset must forget the last generation
    for _ in range(3):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 24))]
        n = rng.randint(1, 40)
        assert engine.generate(prompt, drafter, n).output_ids == engine.generate(prompt, Drafter(VOCAB), n).output_ids


@pytest.mark.device
@pytest.mark.parametrize("kwargs", CONFIGS)
def test_candidates_are_accepted_on_a_repetitive_prompt(llama, kwargs):
    prompt = [3, 17, 42, 8, 3, 17, 42, 8, 3, 17]  # the tiny llama's greedy answer loops with period 3
    engine = Engine(llama, set())
    gen = engine.generate(prompt, Lookahead(VOCAB, DEVICE, **kwargs), 96)  # the window needs ~35 steps to find the loop
    assert gen.output_ids == engine.generate(prompt, Drafter(VOCAB), 96).output_ids
    mat = sum(gen.accept_lengths) / len(gen.accept_lengths)
    assert mat > 1.5, f"the pool's n-grams should be accepted on a repeating continuation (MAT {mat:.2f})"


@torch.inference_mode()
def reference_lade(model, prompt: list[int], max_new: int, N: int, W: int, G: int, seed: int) -> list[int]:
    """The accept lengths of the reference greedy loop (lade ``jacobi_greedy_search_multilevel``, ALWAYS_FWD_ONE,
    and the mask of ``j_make_causal_mask_multilevel``), ported literally, without a KV cache."""
    rng, ids, neg = random.Random(seed), list(prompt), float("-inf")
    past = [[rng.choice(prompt) for _ in range(W + N - 3)]] + [None] * (N - 2)
    fill, token_map, accepted = 0, {}, []
    ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    while len(ids) - len(prompt) < max_new:
        root, at = ids[-1], len(ids) - 1
        guess = [t for tup in token_map.get(root, []) for t in tup] if past[N - 2] is not None else []
        levels = past[: fill + 1]
        block = [root] + [t for level in levels for t in level] + guess
        pos = [at] + [at + max(l, 1) + i for l, level in enumerate(levels) for i in range(len(level))]
        pos += list(range(at + 1, at + N)) * (len(guess) // (N - 1))
        size, tiny = len(block), len(levels[0]) + 1
        mask = torch.full((size, size), neg)
        if past[1] is None:
            mask = torch.triu(mask, 1)
        else:
            hm = torch.arange(tiny) < (torch.arange(tiny) + 1).view(tiny, 1)
            for r in range(len(guess)):
                mask[size - len(guess) + r, 0] = 0
                mask[size - len(guess) + r, size - len(guess) + r - r % (N - 1): size - len(guess) + r + 1] = 0
            for ll in range(len(levels)):
                mask[tiny * ll: tiny * (ll + 1), :tiny].masked_fill_(hm, 0)
                for row in range(1, ll + 1):
                    mask[tiny * ll: tiny * (ll + 1), tiny * row: tiny * (row + 1)].fill_diagonal_(0)
        full = torch.triu(torch.full((at + size, at + size), neg), 1)
        full[at:, :at], full[at:, at:] = 0, mask
        pred = model(input_ids=torch.tensor([ids[:-1] + block]), position_ids=torch.tensor([list(range(at)) + pos]),
                     attention_mask=full[None, None]).logits[0, at:].argmax(-1).tolist()
        inp = pred[size - len(guess) - len(past[fill]): size - len(guess)]
        hits = [pred[0]]
        if past[N - 2] is None:
            past[: fill + 1] = [level[1:] for level in levels]
            past[fill + 1] = inp if fill == 0 else inp[1:]
            fill += 1
        else:
            for eg in range(len(guess) // (N - 1)):
                correct = [pred[0]] + pred[size - len(guess) + eg * (N - 1):][: N - 1]
                mine = guess[eg * (N - 1): (eg + 1) * (N - 1)]
                gg = next((g for g in range(N - 1) if mine[g] != correct[g]), N - 1)
                if gg > len(hits) - 1:
                    hits = correct[: gg + 1]
            for i in range(W):
                key, tup = root if i == 0 else past[0][i - 1], tuple(past[l][i] for l in range(1, N - 1)) + (inp[i],)
                reference_add(token_map, key, tup, G)
            past = [past[1][1:]] + past[2:] + [inp]
        hits = hits[: max_new - (len(ids) - len(prompt))]
        ids += hits
        accepted.append(len(hits))
    return accepted


@pytest.mark.parametrize("N, W, G", [(5, 7, 7), (4, 3, 2)])
def test_same_steps_as_the_reference_loop(llama, N, W, G):
    """Window, pool and candidates as published: every step accepts exactly what the reference's would."""
    rng = random.Random(f"reference-{N}")
    engine = Engine(llama, set())
    for prompt in ([3, 17, 42, 8, 3, 17, 42, 8, 3, 17], [rng.randrange(VOCAB) for _ in range(12)]):
        ours = engine.generate(prompt, Lookahead(VOCAB, N=N, W=W, G=G, seed=3), 40).accept_lengths
        assert ours == reference_lade(llama, prompt, 40, N, W, G, seed=3)
