"""Lookahead decoding (Fu et al., ICML 2024, arXiv 2402.02057), as the reference ``lade`` code runs it.

Every forward carries two branches after the root, both as in the paper's combined attention mask:

* the lookahead branch, a 2-D Jacobi window (the engine's *extra* tokens): a grid of ``N-1`` rows and
  ``W`` columns whose row 0 is the root followed by ``W-1`` guesses. Token ``(r, c)`` sits at depth
  ``r + c`` and attends to row 0's columns ``0..c`` and to column ``c`` of rows ``1..r``: one token per
  depth, the Jacobi trajectory of column ``c``. Its argmax guesses depth ``r + c + 1``;
* the verification branch (the engine's *draft nodes*): the pool's n-grams for the root, up to ``G``
  parallel chains of ``N-1`` tokens in BFS order. They never see the window nor the window them, so
  verification is exactly a plain tree's and the output is greedy decoding's.

After the forward, the last row's argmaxes are the Jacobi update. Column ``c`` read down the grid plus
its new argmax is an n-gram whose first token is row 0's column ``c``: it goes into the pool (at most
``G`` per first token, a repeat moves to the back, the oldest goes first). The grid then moves up one
row and left one column: the new root heads row 0, followed by row 1 minus its first column. ``shift``
picks the reference's two modes: ``one`` (``ALWAYS_FWD_ONE=1``, its default and what Spec-Bench ran)
moves one column whatever was accepted; ``accepted`` (``ALWAYS_FWD_ONE=0``) moves ``1 + accepted draft
tokens`` columns so the guesses keep their positions, padding the right end with prompt tokens.

Initialisation, as the reference: row 0 starts as ``W+N-3`` tokens drawn uniformly from the prompt
(``random.Random(seed)``, reseeded every generation like Spec-Bench's copy of it, so a generation depends
only on its prompt); each warm-up step drops a column and adds the last row's argmaxes as a new row,
until ``N-1`` rows of ``W`` remain. Candidates are verified from then on. The pool is emptied every
generation (optionally seeded with every n-gram of the prompt, as the reference's ``fill_pool_with_prompt``).
"""

from __future__ import annotations

import random
from functools import lru_cache
from typing import Callable, Literal, Sequence

import torch

from methods.drafter import Drafter, Step
from methods.tree import Draft, TreeShape

Ngram = tuple[int, ...]


class NgramPool:
    """Up to ``capacity`` n-grams per first token; re-adding one makes it the most recent, the oldest goes first."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._entries: dict[int, dict[Ngram, None]] = {}  # insertion-ordered: oldest first

    def clear(self) -> None:
        self._entries.clear()

    def add(self, key: int, ngram: Ngram) -> None:
        entries = self._entries.setdefault(key, {})
        entries.pop(ngram, None)
        entries[ngram] = None
        if len(entries) > self.capacity:
            del entries[next(iter(entries))]

    def get(self, key: int) -> list[Ngram]:
        """The n-grams after ``key``, oldest first."""
        return list(self._entries.get(key, ()))

    def add_sequence(self, ids: Sequence[int], n: int) -> None:
        """Every n-gram of ``ids``, in order (the reference's prompt seeding)."""
        for start in range(len(ids) - n + 1):
            self.add(ids[start], tuple(ids[start + 1 : start + n]))


def trajectories(root: int, rows: list[list[int]], last: list[int]) -> list[tuple[int, Ngram]]:
    """Each column's (first token, following tokens): row 0 (behind ``root``), the rows below, the new argmax."""
    heads = [root, *rows[0]]
    return [(heads[c], tuple(row[c] for row in rows[1:]) + (last[c],)) for c in range(len(last))]


def advance(rows: list[list[int]], last: list[int], skip: int, pad: Callable[[int], list[int]]) -> list[list[int]]:
    """The steady-state window after a step: up one row, left ``1 + skip`` columns, right end padded.

    ``rows[0]`` excludes the root (it holds ``W-1`` tokens, the other rows ``W``); so does the result's.
    """
    width = len(last)
    moved = [rows[1][1 + skip :]] + [row[skip:] for row in rows[2:]] + [last[skip:]]
    return [row + pad(width - (r == 0) - len(row)) for r, row in enumerate(moved)]


@lru_cache(maxsize=None)
def block_shape(rows: int, cols: int, guesses: int, guess_len: int) -> TreeShape:
    """``guesses`` parallel chains of ``guess_len`` (BFS order), then a ``rows x cols`` window minus its root cell."""
    parents = tuple(0 if d == 0 else 1 + (d - 1) * guesses + j for d in range(guess_len) for j in range(guesses))
    n1 = 1 + guesses * guess_len

    def index(r: int, c: int) -> int:
        return (0 if c == 0 else n1 + c - 1) if r == 0 else n1 + cols - 1 + (r - 1) * cols + c

    cells = [(r, c) for r in range(rows) for c in range(cols) if r or c]
    return TreeShape(
        parents=parents,
        extra_depths=tuple(r + c for r, c in cells),
        extra_visible=tuple(
            tuple(index(0, k) for k in range(c + (r > 0))) + tuple(index(l, c) for l in range(1, r)) for r, c in cells
        ),
    )


class Lookahead(Drafter):
    """The Lookahead drafter: ``N``-grams, a ``W``-column window, up to ``G`` candidates per step."""

    def __init__(
        self,
        vocab_size: int,
        device: torch.device | str = "cpu",
        N: int = 5,
        W: int = 7,
        G: int = 7,
        shift: Literal["one", "accepted"] = "one",
        seed_prompt: bool = False,
        seed: int = 0,
    ):
        if N < 3 or W < 1 or G < 1:
            raise ValueError(f"method.N must be at least 3, method.W and method.G at least 1; got N={N}, W={W}, G={G}")
        if shift not in ("one", "accepted"):
            raise ValueError(f"method.shift must be 'one' or 'accepted', got {shift!r}")
        super().__init__(vocab_size, device)
        self.N, self.W, self.G, self.shift, self.seed_prompt, self.seed = N, W, G, shift, seed_prompt, seed
        self.pool = NgramPool(G)
        self.rows: list[list[int]] = []  # the window; rows[0] excludes the root
        self._prompt: list[int] = []
        self._rng = random.Random(seed)
        self._root = 0

    def _draw(self, n: int) -> list[int]:
        return [self._rng.choice(self._prompt) for _ in range(n)]

    def reset(self, prompt: torch.Tensor, prefill_logits: torch.Tensor | None,
              prefill_hidden: torch.Tensor | None = None) -> None:
        self._prompt = prompt.tolist()
        self._rng.seed(self.seed)
        self.rows = [self._draw(self.W + self.N - 3)]
        self.pool.clear()
        if self.seed_prompt:
            self.pool.add_sequence(self._prompt, self.N)

    def propose(self, ids: list[int]) -> Draft:
        self._root = ids[-1]
        guesses = self.pool.get(self._root) if len(self.rows) == self.N - 1 else []
        tokens = [g[d] for d in range(self.N - 1) for g in guesses] + [t for row in self.rows for t in row]
        shape = block_shape(len(self.rows), len(self.rows[0]) + 1, len(guesses), self.N - 1)
        return Draft(torch.tensor(tokens, dtype=torch.long, device=self.device), shape)

    def observe(self, step: Step) -> None:
        cols = len(self.rows[0]) + 1
        if len(self.rows) < self.N - 1:  # warm-up: one column fewer, one row more
            self.rows = [row[1:] for row in self.rows] + [step.predictions[1 - cols :].tolist()]
            return
        last = step.predictions[-cols:].tolist()  # the last row's argmaxes: the Jacobi update
        for key, ngram in trajectories(self._root, self.rows, last):
            self.pool.add(key, ngram)
        skip = len(step.accepted) - 1 if self.shift == "accepted" else 0
        self.rows = advance(self.rows, last, skip, self._draw)

    def describe(self) -> dict:
        return {
            "window": [self.N - 1, self.W],
            "max_candidates": self.G,
            "max_block": 1 + self.G * (self.N - 1) + (self.N - 1) * self.W - 1,
        }
