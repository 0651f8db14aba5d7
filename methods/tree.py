"""Draft trees: what a drafter proposes and the engine verifies in one forward pass.

A verification block is ``[root, node_1 .. node_n, extra_1 .. extra_m]``:

* the root is the last token already emitted (its KV entry is not in the cache yet);
* nodes are draft candidates; node ``i`` has a parent ``parents[i-1] < i`` (0 = the root), so the
  block is in BFS/topological order and a chain is the tree whose parents are ``0, 1, 2, ...``;
* extras are non-candidate tokens (e.g. Lookahead's Jacobi window): the engine computes their logits
  and hands them back to the drafter, but never accepts them and drops their KV entries.

The topology lives in a :class:`TreeShape`, built once per shape (static templates build it once per
run); everything the engine derives from it (depths, ancestor matrix, additive mask block) is cached
on the shape, per device and dtype, so a decoding step only indexes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from typing import Sequence

import numpy as np
import torch
import yaml

from methods.paths import PROJECT_ROOT

TEMPLATES = PROJECT_ROOT / "conf" / "trees"


@dataclass(frozen=True)
class ShapeBuffers:
    """Device tensors derived from a :class:`TreeShape` (built once per device and dtype)."""

    depths: torch.Tensor  # [size] long: position offset of every block token from the root
    parents: torch.Tensor  # [n] long: parent index of every node (for the acceptance test)
    ancestors: torch.Tensor  # [n+1, n+1] bool: ancestors[i, j] = j is i or one of i's ancestors
    paths: torch.Tensor  # [n+1, max_depth+1] long: root-to-node indices, padded with the node itself
    mask_block: torch.Tensor  # [size, size] additive float: 0 where visible, finfo.min elsewhere


@dataclass(frozen=True, eq=False)
class TreeShape:
    """The topology of a verification block (root, ``n`` draft nodes, ``m`` extra tokens).

    ``extra_depths[j]`` is extra token ``j``'s position offset from the root and ``extra_visible[j]``
    the block indices it attends to (besides the cached prefix and itself). Draft nodes never see
    extras, so the candidates' logits are exactly those of a plain tree.
    """

    parents: tuple[int, ...]
    extra_depths: tuple[int, ...] = ()
    extra_visible: tuple[tuple[int, ...], ...] = ()
    _buffers: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for i, p in enumerate(self.parents, start=1):
            if not 0 <= p < i:
                raise ValueError(
                    f"draft node {i} has parent {p}: a parent must come earlier in the block "
                    "(0 = root), i.e. nodes must be listed in BFS order"
                )
        if len(self.extra_depths) != len(self.extra_visible):
            raise ValueError("extra_depths and extra_visible must have one entry per extra token")
        for j, seen in enumerate(self.extra_visible):
            bad = [k for k in seen if not 0 <= k < self.size]
            if bad:
                raise ValueError(f"extra token {j} attends to block indices {bad} outside 0..{self.size - 1}")

    @property
    def n_nodes(self) -> int:
        """Root plus draft nodes: the candidates the acceptance test looks at."""
        return len(self.parents) + 1

    @property
    def size(self) -> int:
        """Tokens in the block fed to the model."""
        return self.n_nodes + len(self.extra_depths)

    @cached_property
    def depth_list(self) -> tuple[int, ...]:
        """Depth of every block token (root = 0), host-side."""
        depth = [0]
        for p in self.parents:
            depth.append(depth[p] + 1)
        return tuple(depth) + tuple(self.extra_depths)

    @cached_property
    def is_chain(self) -> bool:
        """True when the block is causal (no branches, no extras): the model's own mask is exact."""
        return not self.extra_depths and all(p == i for i, p in enumerate(self.parents))

    @cached_property
    def sibling_ranks(self) -> tuple[int, ...]:
        """Every node's index among its parent's children in block order (root: 0), host-side.

        For a template filled by rank (Token Recycling), this is the node's successor rank; for any
        drafter it is "the how-many-th alternative at this depth", which acceptance statistics count.
        """
        seen: dict[int, int] = {}
        ranks = [0]
        for p in self.parents:
            ranks.append(seen.get(p, 0))
            seen[p] = ranks[-1] + 1
        return tuple(ranks)

    @cached_property
    def paths(self) -> tuple[tuple[int, ...], ...]:
        """Block indices from the root to every node, host-side (``paths[0] == (0,)``)."""
        paths = [(0,)]
        for i, p in enumerate(self.parents, start=1):
            paths.append(paths[p] + (i,))
        return tuple(paths)

    def buffers(self, device: torch.device, dtype: torch.dtype) -> ShapeBuffers:
        """Device tensors for this shape, built on first use and cached."""
        key = (torch.device(device), dtype)
        if key not in self._buffers:
            self._buffers[key] = self._build(*key)
        return self._buffers[key]

    def _build(self, device: torch.device, dtype: torch.dtype) -> ShapeBuffers:
        """Built on the host (numpy) and moved once per buffer: a new shape's only transfers, never repeated."""
        n1, size = self.n_nodes, self.size
        visible = np.zeros((size, size), dtype=bool)
        for i, path in enumerate(self.paths):
            visible[i, list(path)] = True
        for j, seen in enumerate(self.extra_visible):
            row = n1 + j
            visible[row, list(seen)] = True
            visible[row, row] = True
        max_depth = max(self.depth_list[:n1])
        paths = np.array([p + (p[-1],) * (max_depth + 1 - len(p)) for p in self.paths], dtype=np.int64)
        mask = torch.zeros(size, size, dtype=dtype).masked_fill_(torch.from_numpy(~visible), torch.finfo(dtype).min)
        return ShapeBuffers(
            depths=torch.from_numpy(np.array(self.depth_list, dtype=np.int64)).to(device),
            parents=torch.from_numpy(np.array(self.parents, dtype=np.int64)).to(device),
            ancestors=torch.from_numpy(visible[:n1, :n1].copy()).to(device),
            paths=torch.from_numpy(paths).to(device),
            mask_block=mask.to(device),
        )


@lru_cache(maxsize=None)
def chain(n: int) -> TreeShape:
    """A chain of ``n`` draft tokens after the root (``chain(0)`` is the baseline's single root)."""
    return TreeShape(parents=tuple(range(n)))


@lru_cache(maxsize=1024)
def interned(parents: tuple[int, ...]) -> TreeShape:
    """The one shared shape of a draft tree with these ``parents`` (a bounded LRU of recent shapes).

    For drafters whose tree changes from step to step (e.g. a retrieved chain merged into another
    tree): a recurring tree reuses its shape and the device buffers cached on it, instead of
    rebuilding them every step.
    """
    return TreeShape(parents=parents)


def from_rank_paths(paths: Sequence[Sequence[int]]) -> tuple[TreeShape, torch.Tensor]:
    """A static tree template (a list of rank paths from the root) as a shape plus each node's rank.

    ``[0, 1]`` is the rank-1 successor of the rank-0 successor of the root. Paths are sorted into BFS
    order (by depth, then lexicographically); every prefix of a path must itself be a path.
    Returns the shape and ``ranks`` ([n] long), the last rank of every node in block order.
    """
    ordered = sorted({tuple(p) for p in paths}, key=lambda p: (len(p), p))
    if any(len(p) == 0 for p in ordered):
        raise ValueError("a tree template path must not be empty (the root is implicit)")
    index = {(): 0}
    parents, ranks = [], []
    for i, path in enumerate(ordered, start=1):
        parent = path[:-1]
        if parent not in index:
            raise ValueError(f"tree template node {list(path)} has no parent {list(parent)} in the template")
        if path[-1] < 0:
            raise ValueError(f"tree template node {list(path)} has a negative rank")
        index[path] = i
        parents.append(index[parent])
        ranks.append(path[-1])
    return TreeShape(parents=tuple(parents)), torch.tensor(ranks, dtype=torch.long)


def load_template(name: str) -> list[list[int]]:
    """The rank paths of a static tree template ``conf/trees/NAME.yaml`` (key ``paths``)."""
    path = TEMPLATES / f"{name}.yaml"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in TEMPLATES.glob("*.yaml")))
        raise ValueError(f"unknown tree template {name!r} (method.tree); the templates in {TEMPLATES} are: {known}")
    return yaml.safe_load(path.read_text())["paths"]


@dataclass
class Draft:
    """A proposal: the block's tokens after the root (``[n + m]`` long, on the model's device)."""

    tokens: torch.Tensor
    shape: TreeShape

    def __post_init__(self) -> None:
        if self.tokens.shape != (self.shape.size - 1,):
            raise ValueError(f"draft has {tuple(self.tokens.shape)} tokens, its shape needs {self.shape.size - 1}")
