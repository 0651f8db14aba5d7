"""Tree shapes: BFS order, derived buffers and template loading."""

import pytest
import torch

from methods.tree import Draft, TreeShape, chain, from_rank_paths, load_template


def test_chain_is_causal():
    shape = chain(3)
    assert shape.is_chain and shape.size == 4 and shape.depth_list == (0, 1, 2, 3)
    block = shape.buffers("cpu", torch.float32).mask_block
    assert torch.equal(block == 0, torch.ones(4, 4, dtype=torch.bool).tril())


def test_tree_mask_sees_only_ancestors():
    shape = TreeShape(parents=(0, 0, 1))  # root -> 1, 2; 1 -> 3
    buf = shape.buffers("cpu", torch.bfloat16)
    assert buf.mask_block.dtype == torch.bfloat16
    assert not shape.is_chain
    visible = buf.mask_block == 0
    assert visible.tolist() == [
        [True, False, False, False],
        [True, True, False, False],
        [True, False, True, False],
        [True, True, False, True],
    ]
    assert (buf.mask_block[~visible] == torch.finfo(torch.bfloat16).min).all()
    assert shape.paths == ((0,), (0, 1), (0, 2), (0, 1, 3))
    assert buf.paths.tolist() == [[0, 0, 0], [0, 1, 1], [0, 2, 2], [0, 1, 3]]


def test_extras_see_what_they_declare_and_nodes_never_see_extras():
    shape = TreeShape(parents=(0,), extra_depths=(1, 2), extra_visible=((0,), (0, 2)))
    visible = shape.buffers("cpu", torch.float32).mask_block == 0
    assert shape.size == 4 and shape.n_nodes == 2 and shape.depth_list == (0, 1, 1, 2)
    assert not visible[:2, 2:].any()
    assert visible[2].tolist() == [True, False, True, False]
    assert visible[3].tolist() == [True, False, True, True]


@pytest.mark.parametrize("parents", [(1,), (0, 2), (-1,)])
def test_parents_must_come_first(parents):
    with pytest.raises(ValueError, match="BFS order"):
        TreeShape(parents=parents)


def test_rank_paths_are_sorted_into_bfs_order():
    shape, ranks = from_rank_paths([[1], [0, 0], [0], [0, 1]])
    assert shape.parents == (0, 0, 1, 1)
    assert ranks.tolist() == [0, 1, 0, 1]


def test_rank_path_without_parent_is_refused():
    with pytest.raises(ValueError, match=r"no parent \[0, 1\]"):
        from_rank_paths([[0], [0, 1, 0]])


def test_paper_template_matches_the_publication():
    shape, ranks = from_rank_paths(load_template("paper"))
    per_depth = [shape.depth_list.count(d) for d in range(1, 7)]
    assert per_depth == [8, 21, 25, 15, 8, 3] and shape.n_nodes == 81 and int(ranks.max()) == 7


def test_unknown_template_lists_the_known_ones():
    with pytest.raises(ValueError, match="paper"):
        load_template("nope")


def test_draft_size_is_checked():
    with pytest.raises(ValueError, match="shape needs 2"):
        Draft(torch.zeros(3, dtype=torch.long), chain(2))
