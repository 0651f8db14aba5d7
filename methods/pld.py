"""Prompt Lookup Decoding (Saxena, 2023, as Spec-Bench runs it): draft by copying from the context.

The last ``n`` tokens of prompt + output (``n`` from ``max_ngram_size`` down to ``min_ngram_size``) are
looked up among the earlier n-grams of the context, and the tokens that followed the match are proposed
as one chain. No model and no training: it pays off whenever the answer repeats its context
(summaries, code edits, retrieval-augmented QA).

Two choices differ from Spec-Bench's ``find_candidate_pred_tokens``, which rescans the whole context
every step and takes the earliest occurrence that still has ``num_pred_tokens`` tokens after it:

* an incremental index (n-gram -> end of its most recent occurrence) costs O(new tokens) per step, not
  O(context), and the most recent occurrence is the one closest to the current topic;
* when the copied span runs into the end of the context, the copy goes on through the draft itself
  (``draft[k] = (ids + draft)[match_end + 1 + k]``): the same "this n-gram repeats what followed it"
  hypothesis, extended to the tokens it predicts. A periodic tail (a loop, a list) thus yields a full
  chain, every draft has ``num_pred_tokens`` tokens, and one chain shape serves the whole run.
"""

from __future__ import annotations

from typing import Sequence

import torch

from methods.drafter import Drafter, Step
from methods.tree import Draft, chain
from methods.tree_search import TreePlan, as_plan


class NgramIndex:
    """End position of the most recent occurrence of every n-gram (``min_n <= n <= max_n``) of a growing list."""

    def __init__(self, min_n: int, max_n: int):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_ngram_size <= max_ngram_size, got {min_n} and {max_n}")
        self.sizes = range(max_n, min_n - 1, -1)  # longest first
        self._last: dict[tuple[int, ...], int] = {}
        self._end = 0  # n-grams ending before this position are indexed

    def clear(self) -> None:
        self._last.clear()
        self._end = 0

    def extend(self, ids: Sequence[int], end: int) -> None:
        """Index the n-grams of ``ids`` that end at positions ``[indexed so far, end)``."""
        for e in range(self._end, end):
            for n in self.sizes:
                if n <= e + 1:
                    self._last[tuple(ids[e + 1 - n : e + 1])] = e
        self._end = max(self._end, end)

    def continuation(self, ids: Sequence[int], length: int) -> list[int]:
        """``length`` tokens copied after the most recent earlier match of ``ids``' longest indexed suffix.

        Earlier means ending before ``len(ids) - 1`` (the match may overlap the suffix). Empty when no
        suffix of ``min_n`` tokens or more occurs earlier.
        """
        end = len(ids)
        self.extend(ids, end - 1)
        for n in self.sizes:
            if n >= end:
                continue
            match = self._last.get(tuple(ids[end - n :]))
            if match is not None:
                span = list(ids[match + 1 : min(end, match + 1 + length)])
                return (span * (length // len(span) + 1))[:length]
        return []


class PromptLookup(Drafter):
    """The PLD drafter: a chain of ``num_pred_tokens`` copied from the context, or nothing if no n-gram matches.

    ``num_pred_tokens=auto`` hands it a :class:`TreePlan` of chains (one length per context bucket,
    chosen for the hardware by :mod:`methods.tree_search`).
    """

    tree_param = "num_pred_tokens"
    candidate_tree = 16

    def __init__(
        self,
        vocab_size: int,
        device: torch.device | str = "cpu",
        max_ngram_size: int = 3,
        min_ngram_size: int = 1,
        num_pred_tokens: int | TreePlan = 10,
    ):
        if isinstance(num_pred_tokens, int) and num_pred_tokens < 1:
            raise ValueError(f"method.num_pred_tokens must be at least 1, got {num_pred_tokens}")
        super().__init__(vocab_size, device)
        self.index = NgramIndex(min_ngram_size, max_ngram_size)
        # a chain per context bucket (of 0: the plan found no chain worth its cost there)
        self.plan = as_plan([[0] * n for n in range(1, num_pred_tokens + 1)]
                            if isinstance(num_pred_tokens, int) else num_pred_tokens)
        self.fixed = isinstance(num_pred_tokens, int)

    def reset(self, prompt: torch.Tensor, prefill_logits: torch.Tensor | None,
              prefill_hidden: torch.Tensor | None = None) -> None:
        ids = prompt.tolist()
        self.index.clear()
        self.index.extend(ids, len(ids))

    def propose(self, ids: list[int]) -> Draft | None:
        length = len(self.plan.trees[self.plan.index(len(ids))])
        tokens = self.index.continuation(ids, length) if length else []
        if not tokens:
            return None
        return Draft(torch.tensor(tokens, dtype=torch.long, device=self.device), chain(length))

    def observe(self, step: Step) -> None:
        self.plan.observe(step.position + 1, step.fed, step.seconds, step.path_ranks, 1 / step.rows)

    def finish(self) -> dict:
        return self.plan.report()

    def shared(self) -> list[object]:
        return [self.plan]  # one plan for every row of a batch (it corrects itself from all their steps)

    def describe(self) -> dict:
        return {} if self.fixed else {"plan": self.plan.describe()}
