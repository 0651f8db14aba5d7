"""Token Recycling (Luo et al., 2024, arXiv 2408.08696): a training-free drafter.

It keeps an adjacency matrix ``M`` [V, k]: row ``t`` holds the top-k next tokens the model predicted
the last time ``t`` was an input of a verification forward. A static tree template (rank paths)
is filled breadth-first from ``M`` (node token = ``M[parent token, node rank]``), verified by the
engine, and the fresh top-k at every block position overwrite the rows of those positions' tokens.
"""

from __future__ import annotations

from typing import Literal, Sequence

import torch

from methods import tree_search
from methods.drafter import Drafter, Step
from methods.tree import Draft, TreeShape, from_rank_paths, load_template
from methods.tree_search import ShadowTree, TreePlan


class TokenRecycling(Drafter):
    """The Token Recycling drafter.

    ``tree`` is a template name (``conf/trees/``), rank paths, or a :class:`TreePlan` (``tree=auto``:
    one tree per context bucket, chosen for the hardware by :mod:`methods.tree_search`).
    ``start="hot"`` (as published) keeps the matrix across questions and turns; ``start="cold"``
    clears it at every generation and seeds it from the prompt's prefill logits.

    When a token occurs at several block positions of one step, one write wins, deterministically:
    a position on the accepted path beats one off it (its context is the true one); among equals the
    later position in block order wins (the more recent context).
    """

    tree_param = "tree"
    candidate_tree = "wide"
    shadow_param = "shadow"
    statistics_tree = "paper-b3"  # 7 nodes: a pass costs about a greedy run, not the 80-node tree's 1.6x

    def __init__(
        self,
        vocab_size: int,
        device: torch.device | str = "cpu",
        tree: str | Sequence[Sequence[int]] | TreePlan = "paper",
        k: int = 8,
        start: Literal["hot", "cold"] = "hot",
        shadow: str | Sequence[Sequence[int]] | None = None,
    ):
        """``shadow``: a tree filled at every step besides the verified one and scored against the true
        continuation (:class:`ShadowTree`), for acceptance statistics; reported per turn by ``finish``, and
        followed by a plan that corrects itself while it runs (``tree=auto``)."""
        if start not in ("hot", "cold"):
            raise ValueError(f"method.start must be 'hot' or 'cold', got {start!r}")
        if k < 1:
            raise ValueError(f"method.k must be at least 1, got {k}")
        super().__init__(vocab_size, device)
        self.k, self.start = k, start
        self.plan = tree_search.as_plan(tree)
        self._trees: dict[tuple, tuple[TreeShape | None, list]] = {}  # (shape, levels) per tree, built once
        for paths in self.plan.trees:
            self._tree(paths)  # a template that does not fit k fails here
        self.needs_prefill_logits = start == "cold"
        index_dtype = torch.int16 if vocab_size <= torch.iinfo(torch.int16).max else torch.int32
        # One scratch row at index V absorbs the writes that lose a tie (see _write).
        self.matrix = torch.zeros(vocab_size + 1, k, dtype=index_dtype, device=self.device)  # [V+1, k]
        self.shadow = None
        if shadow is not None:
            shape, levels = self._tree(load_template(shadow) if isinstance(shadow, str) else shadow)
            self.shadow, self._shadow_levels = ShadowTree(shape, self.device), levels
            self._shadow_tokens = torch.zeros(shape.n_nodes, dtype=torch.long, device=self.device)
            self.plan.follow(self.shadow)
        self._tokens = torch.zeros(1, dtype=torch.long, device=self.device)  # [root, nodes], grown to the largest tree
        self._root: torch.Tensor | None = None  # the next root, on the device: the last step's bonus token

    def _tree(self, paths: Sequence[Sequence[int]]) -> tuple[TreeShape | None, list]:
        """A tree's shape and one (parents, ranks, slice) triple per depth: the fill is one gather per depth.
        Built once per tree (a plan that corrects itself while it runs may switch between a few)."""
        key = tuple(map(tuple, paths))
        if key not in self._trees:
            self._trees[key] = self._build(key)
        return self._trees[key]

    def _build(self, paths: tuple[tuple[int, ...], ...]) -> tuple[TreeShape | None, list]:
        if not paths:
            return None, []
        shape, ranks = from_rank_paths(paths)
        if int(ranks.max()) >= self.k:
            raise ValueError(f"the tree template uses rank {int(ranks.max())}, but the matrix keeps only "
                             f"k={self.k} successors")
        depths = torch.tensor(shape.depth_list[1:])
        parents = torch.tensor(shape.parents)
        levels = []
        for d in range(1, int(depths.max()) + 1):
            idx = (depths == d).nonzero().flatten()
            first, last = int(idx[0]) + 1, int(idx[-1]) + 2
            levels.append((parents[idx].to(self.device), ranks[idx].to(self.device), slice(first, last)))
        return shape, levels

    def shape(self, context: int = 0) -> TreeShape | None:
        """The tree shape verified at a context length (None: the plan drafts nothing there)."""
        return self._tree(self.plan.trees[self.plan.index(context)])[0]

    def reset(self, prompt: torch.Tensor, prefill_logits: torch.Tensor | None,
              prefill_hidden: torch.Tensor | None = None) -> None:
        self._root = None
        if self.start == "cold":
            self.matrix.zero_()
            self._write(prompt, prefill_logits, priority=torch.arange(len(prompt), device=prompt.device))

    def propose(self, ids: list[int]) -> Draft | None:
        if self.shadow is not None and self.plan.scores():
            self.shadow.add(self._fill(self._shadow_tokens, self._shadow_levels, ids[-1]))
        shape, levels = self._tree(self.plan.trees[self.plan.index(len(ids))])
        if shape is None:  # the plan found no tree worth its cost at this context length
            return None
        if len(self._tokens) < shape.n_nodes:
            self._tokens = torch.zeros(shape.n_nodes, dtype=torch.long, device=self.device)
        return Draft(self._fill(self._tokens, levels, ids[-1])[1 : shape.n_nodes], shape)

    def _fill(self, tokens: torch.Tensor, levels: list, root: int) -> torch.Tensor:
        """``tokens`` = [root, nodes] with node = M[parent's token, node's rank], breadth first. The root comes from
        the device (the last step's bonus token) except at a generation's first step: no host write per step."""
        if self._root is None:
            tokens[:1].fill_(root)
        else:
            tokens[:1].copy_(self._root)
        for parents, ranks, nodes in levels:
            tokens[nodes] = self.matrix[tokens[parents], ranks].long()
        return tokens

    def finish(self) -> dict:
        return {**(self.shadow.finish() if self.shadow is not None else {}), **self.plan.report()}

    def observe(self, step: Step) -> None:
        self.plan.observe(step.position + 1, step.fed, step.seconds, step.path_ranks, 1 / step.rows)
        if self.shadow is not None:
            self.shadow.emitted(step.emitted)
        n1 = step.shape.n_nodes
        self._root = step.predictions.index_select(0, step.accepted[-1:])  # the bonus token: the next root
        priority = torch.arange(n1, device=step.tokens.device)
        priority[step.accepted] += n1
        self._write(step.tokens[:n1], step.logits[:n1], priority)

    def _write(self, tokens: torch.Tensor, logits: torch.Tensor, priority: torch.Tensor) -> None:
        """``M[tokens[i]] = topk(logits[i])``, the highest-priority position winning per token.

        Losing positions are redirected to the scratch row, so the write needs no host sync.
        """
        top = logits.topk(self.k, dim=-1).indices.to(self.matrix.dtype)  # [n, k]
        same = tokens[:, None] == tokens[None, :]  # [n, n]
        beaten = (same & (priority[None, :] > priority[:, None])).any(-1)  # [n]
        self.matrix[torch.where(beaten, self.vocab_size, tokens)] = top

    def fork(self) -> TokenRecycling:
        forked = super().fork()
        if forked.shadow is not None:  # the row's own shadow, scored against its own continuation
            forked.shadow.clear()
            self.plan.follow(forked.shadow)
        return forked

    def shared(self) -> list[object]:
        """The matrix is the hot-start state every row of a batch reads and writes (rows observe in slot order); the
        plan and the built trees are the same for every row."""
        return [self.matrix, self.plan, self._trees]

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"matrix": self.matrix} if self.start == "hot" else {}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.matrix.copy_(state["matrix"])

    def describe(self) -> dict:
        return {
            "matrix_shape": [self.vocab_size, self.k],
            "matrix_dtype": str(self.matrix.dtype).removeprefix("torch."),
            "matrix_bytes": self.vocab_size * self.k * self.matrix.element_size(),
            "tree_nodes": [len(paths) for paths in self.plan.trees],
            "tree_depth": [max(map(len, paths), default=0) for paths in self.plan.trees],
            **({"plan": self.plan.describe()} if self.plan.sources else {}),
        }
