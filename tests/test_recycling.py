"""Token Recycling: BFS fill from the matrix, the deterministic update rule, hot and cold start."""

import pytest
import torch

from conftest import DEVICE, VOCAB, tiny_llama
from methods.drafter import Drafter, Step
from methods.engine import Engine
from methods.recycling import TokenRecycling

TREE = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]


def step_for(drafter: TokenRecycling, tokens: list[int], logits: torch.Tensor, accepted: list[int]) -> Step:
    shape = drafter.shape()
    return Step(position=0, shape=shape, tokens=torch.tensor(tokens), logits=logits, predictions=logits.argmax(-1),
                accepted=torch.tensor(accepted), path_ranks=[shape.sibling_ranks[i] for i in accepted[1:]], emitted=[],
                hidden_states=None)


def logits_ranking(*rows: list[int], vocab: int = VOCAB) -> torch.Tensor:
    """Logits whose top-k order is the given token list, one row per position."""
    out = torch.zeros(len(rows), vocab)
    for i, row in enumerate(rows):
        out[i, row] = torch.linspace(10, 5, len(row))
    return out


def test_bfs_fill_follows_the_matrix():
    d = TokenRecycling(VOCAB, tree=TREE, k=2)
    d.matrix[5] = torch.tensor([6, 7])
    d.matrix[6] = torch.tensor([8, 9])
    d.matrix[7] = torch.tensor([10, 11])
    d.matrix[8] = torch.tensor([12, 13])
    draft = d.propose([1, 2, 5])
    # BFS order of TREE: [0] [1] [0,0] [0,1] [1,0] [0,0,0]
    assert draft.tokens.tolist() == [6, 7, 8, 9, 10, 12]
    assert draft.shape is d.shape()


def test_update_overwrites_rows_and_accepted_positions_win_ties():
    d = TokenRecycling(VOCAB, tree=TREE, k=2)
    tokens = [5, 6, 7, 6, 9, 10, 6]  # token 6 at positions 1, 3 and 6
    logits = logits_ranking([1, 2], [3, 4], [5, 6], [7, 8], [9, 10], [11, 12], [13, 14])
    d.observe(step_for(d, tokens, logits, accepted=[0, 1, 3]))  # root -> [0] -> [0,0]: positions 1 and 3 accepted
    assert d.matrix[5].tolist() == [1, 2]
    assert d.matrix[6].tolist() == [7, 8]  # position 3: accepted and later than position 1; beats unaccepted 6
    assert d.matrix[7].tolist() == [5, 6]
    assert d.matrix[10].tolist() == [11, 12]


def test_later_position_wins_among_unaccepted():
    d = TokenRecycling(VOCAB, tree=TREE, k=2)
    tokens = [5, 6, 7, 8, 7, 10, 11]  # token 7 at positions 2 and 4, neither accepted
    logits = logits_ranking([1, 2], [3, 4], [5, 6], [7, 8], [9, 10], [11, 12], [13, 14])
    d.observe(step_for(d, tokens, logits, accepted=[0]))
    assert d.matrix[7].tolist() == [9, 10]


def test_matrix_dtype_fits_the_vocabulary_and_memory_is_reported():
    assert TokenRecycling(32000, tree=TREE).matrix.dtype == torch.int16
    big = TokenRecycling(262144, tree=TREE)
    assert big.matrix.dtype == torch.int32
    assert big.describe()["matrix_bytes"] == 262144 * 8 * 4
    assert TokenRecycling(32000, tree="paper").describe()["matrix_bytes"] < 2 * 2**20  # the paper: under 2 MB


def test_rank_beyond_k_is_refused():
    with pytest.raises(ValueError, match="k=2"):
        TokenRecycling(VOCAB, tree=[[0], [2]], k=2)


def test_start_must_be_hot_or_cold():
    with pytest.raises(ValueError, match="method.start"):
        TokenRecycling(VOCAB, tree=TREE, start="warm")


def run(drafter: Drafter, prompt: list[int], n: int = 40):
    return Engine(tiny_llama(), set()).generate(prompt, drafter, n)


@pytest.mark.device
@pytest.mark.parametrize("tree", ["paper", "paper-b4", "chain6"])
@pytest.mark.parametrize("start", ["hot", "cold"])
def test_lossless_and_accepting_on_a_tiny_model(tree, start):
    prompt = [3, 17, 42, 8, 3, 17, 42, 8, 3, 17]
    reference = run(Drafter(VOCAB), prompt)
    drafter = TokenRecycling(VOCAB, DEVICE, tree=tree, start=start)
    first = run(drafter, prompt)
    second = run(drafter, prompt)
    assert first.output_ids == reference.output_ids == second.output_ids
    mat = sum(second.accept_lengths) / len(second.accept_lengths)
    assert mat > 1.5, f"the drafter should be accepted often on a repetitive continuation (MAT {mat:.2f})"


def test_hot_start_keeps_the_matrix_and_cold_start_resets_it():
    prompt = [1, 2, 3, 4]
    hot = TokenRecycling(VOCAB, tree=TREE, start="hot")
    run(hot, prompt, 20)
    learned = hot.matrix.clone()
    assert learned.any()
    hot.reset(torch.tensor(prompt), None)
    assert torch.equal(hot.matrix, learned)

    cold = TokenRecycling(VOCAB, tree=TREE, start="cold")
    assert cold.needs_prefill_logits
    cold.matrix.fill_(1)
    logits = logits_ranking(*[[t, t + 1] + list(range(20, 26)) for t in (10, 20, 30, 40)])
    cold.reset(torch.tensor([5, 6, 5, 7]), logits)
    assert cold.matrix[5].tolist()[:2] == [30, 31]  # the later occurrence of 5 wins
    assert cold.matrix[6].tolist()[:2] == [20, 21]
    assert not cold.matrix[8].any()  # untouched rows were cleared


def test_state_dict_round_trip():
    a = TokenRecycling(VOCAB, tree=TREE)
    run(a, [4, 5, 6], 16)
    b = TokenRecycling(VOCAB, tree=TREE)
    b.load_state_dict(a.state_dict())
    assert torch.equal(a.matrix, b.matrix)
