"""Choosing the draft tree for the hardware: expected accepted tokens per step over measured step time.

Acceptance statistics give, for every node of a wide candidate tree (a rank path such as ``(0, 1)``),
the share ``p`` of drafting steps in which it lay on the accepted path. A step accepts the nodes of one
root path, so a tree ``S`` (closed under parents) emits ``1 + sum(p[i] for i in S)`` tokens per
drafting step, bonus included. A node is accepted only with its parent, so ``p[child] <= p[parent]``
and the best tree of ``n`` nodes is the ``n`` most-accepted nodes (ties broken by depth, which keeps
every parent in). Within the candidate set this is exact, so no search over shapes is needed; Sequoia's
dynamic program builds trees outside it from a per-rank acceptance model, which we replace by
measuring every node.

The size is the one that maximises expected tokens per step / step time, with the step time read off
the device calibration at the context length. The time of a tree's forward grows with the context
(its queries attend to the whole prefix), so a plan holds one tree per context bucket.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

RankPath = tuple[int, ...]


@dataclass(frozen=True)
class NodeStats:
    """Measured acceptance of a candidate tree's nodes."""

    probs: Mapping[RankPath, float]  # share of drafting steps in which the node was accepted
    draft_rate: float = 1.0  # share of steps that drafted at all (PLD: a match was found)

    def ranked(self) -> list[tuple[RankPath, float]]:
        """Nodes that were ever accepted, best first; every prefix of the list is a tree."""
        nodes = [(path, p) for path, p in self.probs.items() if p > 0]
        return sorted(nodes, key=lambda item: (-item[1], len(item[0]), item[0]))


@dataclass(frozen=True)
class Choice:
    """The tree chosen for one context bucket, with what the cost model predicts for it."""

    paths: tuple[RankPath, ...]  # rank paths in BFS order
    context: int  # the context length the choice was made at
    draft_rate: float  # share of steps expected to draft (1 for a tree that is always filled)
    expected_tokens: float  # per step, bonus included
    step_ms: float  # predicted time of one step
    tokens_per_s: float  # predicted decode tokens/s
    baseline_tokens_per_s: float  # predicted for greedy decoding (no draft) at the same context

    @property
    def n_nodes(self) -> int:
        return len(self.paths)

    def describe(self) -> dict:
        depth = max((len(p) for p in self.paths), default=0)
        return {
            "context": self.context, "nodes": self.n_nodes, "depth": depth, "draft_rate": round(self.draft_rate, 4),
            "widths": [sum(len(p) == d for p in self.paths) for d in range(1, depth + 1)],
            "expected_tokens": round(self.expected_tokens, 4), "step_ms": round(self.step_ms, 3),
            "predicted_tokens_per_s": round(self.tokens_per_s, 3),
            "predicted_speedup": round(self.tokens_per_s / self.baseline_tokens_per_s, 4),
        }


@dataclass(frozen=True)
class TreePlan:
    """One tree per context bucket: ``choices[j]`` serves contexts below ``bounds[j]`` (the last: the rest)."""

    choices: tuple[Choice, ...]
    bounds: tuple[int, ...] = ()
    sources: dict = field(default_factory=dict, compare=False)  # files the plan was made from

    def __post_init__(self) -> None:
        if len(self.bounds) != len(self.choices) - 1:
            raise ValueError("a tree plan needs one bound between every two buckets")

    def index(self, context: int) -> int:
        """The bucket of a context length (prompt + output so far)."""
        return bisect.bisect_right(self.bounds, context)

    @property
    def trees(self) -> list[tuple[RankPath, ...]]:
        return [c.paths for c in self.choices]

    def describe(self) -> dict:
        return {"buckets": [{"below": b, **c.describe()} for c, b in zip(self.choices, [*self.bounds, None])],
                "sources": self.sources}


def best_tree(stats: NodeStats, step_seconds: Callable[[int], float], max_nodes: int | None = None,
              context: int = 0) -> Choice:
    """The tree maximising expected tokens per second, given the time of a step that verifies ``q`` tokens.

    Steps that do not draft (``1 - draft_rate`` of them) verify the root alone.
    """
    ranked = stats.ranked()[:max_nodes]
    rate = stats.draft_rate
    base = step_seconds(1)
    best: tuple[float, int, float, float] | None = None
    gain = 0.0
    for n in range(len(ranked) + 1):
        if n:
            gain += ranked[n - 1][1]
        tokens = 1 + rate * gain
        seconds = rate * step_seconds(n + 1) + (1 - rate) * base if n else base
        speed = tokens / seconds
        if best is None or speed > best[0] + 1e-12:
            best = (speed, n, tokens, seconds)
    speed, n, tokens, seconds = best
    paths = tuple(sorted((p for p, _ in ranked[:n]), key=lambda p: (len(p), p)))
    return Choice(paths=paths, context=context, draft_rate=rate if n else 0.0, expected_tokens=tokens, step_ms=1000 * seconds,
                  tokens_per_s=speed, baseline_tokens_per_s=1 / base)


def plan(stats: NodeStats, step_seconds: Callable[[int, int], float], contexts: Sequence[int],
         max_nodes: int | None = None, sources: dict | None = None) -> TreePlan:
    """A tree per calibrated context; a bucket ends halfway (geometrically) to the next context.

    Adjacent buckets that chose the same tree are merged, so a plan whose choice does not depend on
    the context holds a single tree.
    """
    contexts = sorted(set(contexts))
    if not contexts:
        raise ValueError("a tree plan needs at least one calibrated context length")
    choices = [best_tree(stats, lambda q, c=c: step_seconds(q, c), max_nodes, c) for c in contexts]
    bounds = [math.isqrt(a * b) for a, b in zip(contexts, contexts[1:])]
    merged, kept = [choices[0]], []
    for choice, bound in zip(choices[1:], bounds):
        if choice.paths == merged[-1].paths:
            continue
        merged.append(choice)
        kept.append(bound)
    return TreePlan(choices=tuple(merged), bounds=tuple(kept), sources=dict(sources or {}))


def fixed(paths: Sequence[Sequence[int]]) -> TreePlan:
    """A plan with one given tree for every context (predictions unknown)."""
    nan = math.nan
    return TreePlan(choices=(Choice(tuple(map(tuple, paths)), 0, nan, nan, nan, nan, nan),))
