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
(its queries attend to the whole prefix), so a plan holds one tree per context bucket. A drafter that
runs a forward of its own per depth (EAGLE's head) adds its drafting time (:class:`DraftCost`) to the
step: then the tree is the ``n`` most-accepted nodes no deeper than ``D``, for the best ``n`` and ``D``.

Both inputs are measured, so both are uncertain: the step times have bootstrap replicates
(:class:`methods.costs.CostCurve`) and the acceptance shares come from a finite number of steps. Every
candidate's predicted speed gets a replicate per calibration replicate, and the plan takes the *cheapest*
candidate that the fastest one does not beat in ``CONFIDENCE`` of the replicates: a larger tree must win by
more than the uncertainty of its prediction, and where no tree beats drafting nothing, the plan drafts
nothing and says so (its predicted speedup's interval includes 1.0x).
"""

from __future__ import annotations

import bisect
import math
from collections import defaultdict
from dataclasses import dataclass, field
from functools import cached_property
from typing import Callable, Mapping, Sequence

import numpy as np
import torch

from methods.costs import CONFIDENCE, REPLICATES, bounds, exact
from methods.tree import TreeShape, load_template

RankPath = tuple[int, ...]


@dataclass(frozen=True)
class NodeStats:
    """Measured acceptance of a candidate tree's nodes."""

    probs: Mapping[RankPath, float]  # share of drafting steps in which the node was accepted
    draft_rate: float = 1.0  # share of steps that drafted at all (PLD: a match was found)
    steps: int = 0  # drafting steps the shares were measured on (0: exact, e.g. a synthetic test)

    def ranked(self) -> list[tuple[RankPath, float]]:
        """Nodes that were ever accepted, best first; every prefix of the list is a tree."""
        nodes = [(path, p) for path, p in self.probs.items() if p > 0]
        return sorted(nodes, key=lambda item: (-item[1], len(item[0]), item[0]))


@dataclass(frozen=True)
class DraftCost:
    """A drafter's own seconds per draft, by the tree's shape (measured by ``evaluation.calibrate``).

    ``base + per_level * (depth - 1) + per_node * inner``, ``inner`` counting the draft nodes with
    children: a drafter that grows its tree with one forward per depth (EAGLE's head) pays a fixed cost
    (catching up with the accepted tokens, the first depth's predictions), a forward per further depth,
    and per node fed to those forwards (its output projection).
    """

    base: float
    per_level: float
    per_node: float

    def seconds(self, depth: int, inner: int) -> float:
        return 0.0 if depth == 0 else self.base + self.per_level * (depth - 1) + self.per_node * inner


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
    draft_ms: float | None = None  # the drafter's own predicted time per drafting step (in step_ms; None: not modelled)
    speedup_interval: tuple[float, float] | None = None  # the predicted speedup's 90% interval over the replicates

    @property
    def n_nodes(self) -> int:
        return len(self.paths)

    def describe(self) -> dict:
        depth = max((len(p) for p in self.paths), default=0)
        return {
            "context": self.context, "nodes": self.n_nodes, "depth": depth, "draft_rate": round(self.draft_rate, 4),
            "widths": [sum(len(p) == d for p in self.paths) for d in range(1, depth + 1)],
            "expected_tokens": round(self.expected_tokens, 4), "step_ms": round(self.step_ms, 3),
            **({"draft_ms": round(self.draft_ms, 3)} if self.draft_ms is not None else {}),
            "predicted_tokens_per_s": round(self.tokens_per_s, 3),
            "predicted_speedup": round(self.tokens_per_s / self.baseline_tokens_per_s, 4),
            **_interval(self.speedup_interval),
        }


def _interval(interval: tuple[float, float] | None) -> dict:
    """A predicted speedup's interval as a plan records it, and whether it clears 1.0x."""
    if interval is None:
        return {}
    return {"predicted_speedup_interval": [round(v, 4) for v in interval], "beyond_noise": interval[0] > 1.0}


@dataclass(frozen=True)
class TreePlan:
    """One tree per context bucket: ``choices[j]`` serves contexts below ``bounds[j]`` (the last: the rest)."""

    choices: tuple[Choice, ...]
    bounds: tuple[int, ...] = ()
    sources: dict = field(default_factory=dict, compare=False)  # files the plan was made from

    def __post_init__(self) -> None:
        if len(self.bounds) != len(self.choices) - 1:
            raise ValueError("a tree plan needs one bound between every two buckets")

    version = 0  # a plan that corrects itself while it runs (methods.online) counts its changes here

    def index(self, context: int) -> int:
        """The bucket of a context length (prompt + output so far)."""
        return bisect.bisect_right(self.bounds, context)

    @property
    def trees(self) -> list[tuple[RankPath, ...]]:
        return [c.paths for c in self.choices]

    def observe(self, context: int, fed: int, seconds: float, ranks: Sequence[int], share: float = 1.0) -> None:
        """A step made with this plan (a fixed plan learns nothing; methods.online's does); ``share``: the part of
        the step this row is (1 / the rows of a batch that verified it)."""

    def follow(self, shadow: ShadowTree) -> None:
        """A candidate tree the drafter scores in the shadow of every step (a fixed plan ignores it;
        methods.online's takes its exact acceptance of every node, drafting or not)."""

    def scores(self) -> bool:
        """Whether the drafter proposing now scores its shadow (always, for a fixed plan)."""
        return True

    def report(self) -> dict:
        """What the plan did during a turn, for the turn's record ({} for a fixed plan)."""
        return {}

    def describe(self) -> dict:
        return {"buckets": [{"below": b, **c.describe()} for c, b in zip(self.choices, [*self.bounds, None])],
                "sources": self.sources}


def _replicates(cost: Callable[[int], float]) -> Callable[[int], np.ndarray]:
    """A cost's replicates ([B] seconds per block size): its own where it has them, else the value itself."""
    return getattr(cost, "replicates", None) or exact(cost)


def best_tree(stats: NodeStats, step_seconds: Callable[[int], float], max_nodes: int | None = None,
              context: int = 0, draft: DraftCost | None = None, confidence: float = CONFIDENCE) -> Choice:
    """The tree to verify: the cheapest candidate that the one of most expected tokens per second does not beat
    in ``confidence`` of the replicates (of the step times, where ``step_seconds`` has them: a
    :class:`~methods.costs.ContextCost`, and of the acceptance, drawn from its standard error).

    Steps that do not draft (``1 - draft_rate`` of them) verify the root alone. With a drafting cost that
    grows with depth, every depth limit ``D`` is tried: the ``n`` most-accepted nodes no deeper than ``D``
    still form a tree (a parent is shallower and at least as likely).
    """
    ranked = stats.ranked()[:max_nodes]
    rate = stats.draft_rate
    reps = _replicates(step_seconds)
    base, base_b = step_seconds(1), reps(1)
    noise = np.random.default_rng(0).standard_normal(REPLICATES)  # common to every candidate: a paired comparison
    limits = sorted({len(p) for p, _ in ranked}) if draft is not None else [None]
    candidates = []  # per candidate: (paths, tokens, drafting, the tokens' standard error)
    for limit in limits:
        nodes = [(p, q) for p, q in ranked if limit is None or len(p) <= limit]
        gain, depth, inner, parents, mean, square = 0.0, 0, 0, set(), 0.0, 0.0
        for n in range(len(nodes) + 1):
            drafting = 0.0
            if n:
                path, p = nodes[n - 1]
                gain += p
                # a step's accepted drafts L are the nodes of one root path: a node's indicator overlaps its
                # ancestors' and excludes its siblings', so E[L^2] = sum_j p_j (2 depth_j - 1)
                mean, square = mean + p, square + p * (2 * len(path) - 1)
                depth = max(depth, len(path))
                if len(path) > 1 and path[:-1] not in parents:
                    parents.add(path[:-1])
                    inner += 1
                drafting = draft.seconds(depth, inner) if draft is not None else 0.0
            se = rate * math.sqrt(max(square - mean * mean, 0.0) / stats.steps) if stats.steps else 0.0
            candidates.append((tuple(p for p, _ in nodes[:n]), 1 + rate * gain, drafting, se))
    # every candidate at once: its time and tokens per second, point and per replicate
    sizes = [len(c[0]) + 1 for c in candidates]
    drafting = np.array([c[2] for c in candidates])
    tokens = np.array([c[1] for c in candidates])
    seconds = np.where([len(c[0]) > 0 for c in candidates],
                       rate * (np.array([step_seconds(q) for q in sizes]) + drafting) + (1 - rate) * base, base)
    seconds_b = np.where(np.array([len(c[0]) > 0 for c in candidates])[:, None],
                         rate * (np.stack([np.broadcast_to(reps(q), base_b.shape) for q in sizes]) + drafting[:, None])
                         + (1 - rate) * base_b, base_b)  # [candidates, B]
    tokens_b = np.maximum(tokens[:, None] + noise[None, :] * np.array([c[3] for c in candidates])[:, None], 1.0)
    speed, speed_b = tokens / seconds, tokens_b / seconds_b
    fastest = int(np.argmax(speed))
    # the cheapest candidate the fastest does not clearly beat (the fastest itself at worst)
    beaten = np.mean(speed_b[fastest][None, :] > speed_b, axis=1) >= confidence
    beaten[fastest] = False
    allowed = np.flatnonzero(~beaten)
    pick = int(allowed[np.lexsort((-speed[allowed], seconds[allowed]))[0]])
    chosen, tokens_i, drafting_i = candidates[pick][0], float(tokens[pick]), float(drafting[pick])
    paths = tuple(sorted(chosen, key=lambda p: (len(p), p)))
    interval = tuple(float(v) for v in np.quantile(speed_b[pick] * base_b, [0.05, 0.95]))
    return Choice(paths=paths, context=context, draft_rate=rate if paths else 0.0, expected_tokens=tokens_i,
                  step_ms=1000 * float(seconds[pick]), tokens_per_s=float(speed[pick]), baseline_tokens_per_s=1 / base,
                  draft_ms=1000 * drafting_i if draft is not None else None, speedup_interval=interval)


def evaluate(stats: NodeStats, tree: Sequence[RankPath], step_seconds: Callable[[int], float], context: int = 0,
             draft: DraftCost | None = None) -> Choice:
    """What the cost model predicts for a given tree (no search): its tokens and time per step."""
    paths = tuple(sorted(map(tuple, tree), key=lambda p: (len(p), p)))
    base = step_seconds(1)
    rate = stats.draft_rate if paths else 0.0
    depth = max(map(len, paths), default=0)
    drafting = draft.seconds(depth, len({p[:-1] for p in paths if len(p) > 1})) if draft is not None else 0.0
    tokens = 1 + rate * sum(stats.probs.get(p, 0.0) for p in paths)
    seconds = rate * (step_seconds(len(paths) + 1) + drafting) + (1 - rate) * base if paths else base
    return Choice(paths=paths, context=context, draft_rate=rate, expected_tokens=tokens, step_ms=1000 * seconds,
                  tokens_per_s=tokens / seconds, baseline_tokens_per_s=1 / base,
                  draft_ms=1000 * drafting if draft is not None else None)


def plan(stats: NodeStats, cost_at: Callable[[int], Callable[[int], float]], contexts: Sequence[int],
         max_nodes: int | None = None, sources: dict | None = None,
         draft: Callable[[int], DraftCost] | None = None, rows: int = 1) -> TreePlan:
    """A tree per calibrated context, ``cost_at(context)`` being the step cost there (a function of the block
    size, with replicates where it has them); a bucket ends halfway (geometrically) to the next context.
    ``draft``: the drafter's own cost at a context length, for drafters that have one worth modelling.

    Adjacent buckets that chose the same tree are merged, so a plan whose choice does not depend on
    the context holds a single tree. ``rows`` > 1 (a batch): one tree for every context (:func:`_one_tree`).
    """
    contexts = sorted(set(contexts))
    if not contexts:
        raise ValueError("a tree plan needs at least one calibrated context length")
    choices = [best_tree(stats, cost_at(c), max_nodes, c, draft(c) if draft else None) for c in contexts]
    if rows > 1:
        choices = _one_tree(stats, cost_at, contexts, choices, draft)
    merged, kept = _buckets(contexts, choices, lambda choice: choice.paths)
    return TreePlan(choices=merged, bounds=kept, sources=dict(sources or {}))


def _one_tree(stats: NodeStats, cost_at: Callable[[int], Callable[[int], float]], contexts: Sequence[int],
              choices: Sequence[Choice], draft: Callable[[int], DraftCost] | None) -> list[Choice]:
    """A batch's rows are at different contexts, and a step feeds the largest of their trees: a plan that drafts
    at short contexts and not at long ones makes the long rows pay for the short rows' tree at almost every step
    (Token Recycling ran 0.91x at 8 rows so). So every context gets one tree: of those the contexts chose (each
    the cheapest its fastest does not clearly beat), the one that yields the most tokens per second over a run
    whose steps are at every calibrated context alike (its tokens over its seconds, summed over the contexts: a
    tree that wins 2x where steps are cheap and loses 3x where they are dear loses), the smaller on a tie."""
    def at(tree: tuple[RankPath, ...]) -> list[Choice]:
        return [evaluate(stats, tree, cost_at(c), c, draft(c) if draft else None) for c in contexts]

    scored = []
    for tree in {choice.paths for choice in choices}:
        predicted = at(tree)
        speed = sum(ch.expected_tokens for ch in predicted) / sum(ch.step_ms for ch in predicted)
        scored.append((round(speed, 12), -len(tree), predicted))
    return max(scored, key=lambda s: s[:2])[2]


def _buckets(contexts: Sequence[int], choices: Sequence, same: Callable) -> tuple[tuple, tuple[int, ...]]:
    """Choices made at sorted calibrated contexts as buckets: each ends halfway (geometrically) to the next
    context, and neighbours whose ``same(choice)`` agree merge."""
    merged, kept = [choices[0]], []
    for choice, bound in zip(choices[1:], bounds(contexts)):
        if same(choice) == same(merged[-1]):
            continue
        merged.append(choice)
        kept.append(bound)
    return tuple(merged), tuple(kept)


def fixed(paths: Sequence[Sequence[int]]) -> TreePlan:
    """A plan with one given tree for every context (predictions unknown)."""
    nan = math.nan
    return TreePlan(choices=(Choice(tuple(map(tuple, paths)), 0, nan, nan, nan, nan, nan),))


def as_plan(tree: object) -> TreePlan:
    """A drafter's ``tree`` argument as a plan: a plan (``tree=auto``: a :class:`TreePlan`, or one that corrects
    itself while it runs, :mod:`methods.online`) as it is, a template name or rank paths as a fixed plan."""
    if hasattr(tree, "trees"):
        return tree
    return fixed(load_template(tree) if isinstance(tree, str) else tree)


class ShadowTree:
    """Acceptance of a tree that a drafter fills but does not verify, scored against the true continuation.

    Greedy output does not depend on the drafts, so once the tokens after a step are known, whether a
    node of any tree would have been accepted at that step is exact: its path's tokens equal the next
    tokens. This measures a wide candidate tree under the drafter's state as it evolves with the tree
    actually verified (Token Recycling's matrix learns only from verified positions, so a wide tree's
    own run overstates what its small subtrees accept).
    """

    def __init__(self, shape: TreeShape, device: torch.device):
        buf = shape.buffers(device, torch.float32)
        n1 = shape.n_nodes
        self.depth = max(shape.depth_list[:n1])
        self._offsets = buf.depths[1:n1] - 1  # node at depth d must equal the d-th token after the root
        self._ancestors = buf.ancestors
        ranks = shape.sibling_ranks
        #: every node's rank path, in node order
        self.paths: tuple[RankPath, ...] = tuple(tuple(ranks[j] for j in path[1:]) for path in shape.paths[1:])
        self._names = [".".join(map(str, path)) for path in self.paths]
        #: per node, the steps that would have accepted it, over every generation so far; and the steps scored:
        #: what a plan that corrects itself while it runs reads (methods.online); ``finish`` hands over a turn's
        self.run_counts = torch.zeros(n1 - 1, dtype=torch.long, device=device)
        self.run_steps = 0
        self._turn = (self.run_counts.clone(), 0)  # the counts when the generation started
        self._pending: list[tuple[int, torch.Tensor]] = []
        self._stream: list[int] = []

    def clear(self) -> None:
        """Forget every count (a copy made for another row of a batch starts from none)."""
        self.run_counts.zero_()
        self.run_steps = 0
        self._turn = (self.run_counts.clone(), 0)
        self._pending, self._stream = [], []

    def add(self, tokens: torch.Tensor) -> None:
        """A step's filled tree ([root, nodes]), to be scored once the tokens after its root are known."""
        self._pending.append((len(self._stream), tokens.clone()))

    def emitted(self, tokens: list[int]) -> None:
        self._stream += tokens
        self._score(final=False)

    def finish(self) -> dict:
        """Score what is pending (the end of a generation cuts the continuation) and hand over the counts."""
        self._score(final=True)
        counts = (self.run_counts - self._turn[0]).tolist()
        out = {"shadow_steps": self.run_steps - self._turn[1],
               "shadow_accepted": {name: n for name, n in zip(self._names, counts) if n}}
        self._turn = (self.run_counts.clone(), self.run_steps)
        self._stream = []
        return out

    def _score(self, final: bool) -> None:
        waiting = []
        for start, tokens in self._pending:
            known = self._stream[start : start + self.depth]
            if len(known) < self.depth and not final:
                waiting.append((start, tokens))
                continue
            truth = torch.tensor(known + [-1] * (self.depth - len(known)), device=tokens.device)
            correct = torch.ones(len(tokens), dtype=torch.bool, device=tokens.device)
            correct[1:] = tokens[1:] == truth[self._offsets]
            self.run_counts += (~(self._ancestors & ~correct).any(-1))[1:]
            self.run_steps += 1
        self._pending = waiting


# Per-step policies: a drafter that knows, before drafting, how good its draft is likely to be (SAM's
# match length) drafts differently by that class. A drafter reports the class of every step and, scored
# against the true continuation, how deep its retrieved chain (``chain``, up to its scored length) and its
# auxiliary tree (``aux``) would have been accepted; a step verifying the chain cut to ``L`` tokens and/or
# the auxiliary tree accepts ``max(min(chain, L), aux)`` draft tokens (a trie merge keeps both paths).

MAX_CLASS = 16  # match lengths from here on share one class


@dataclass(frozen=True)
class StepOption:
    """What one class of steps verifies: the auxiliary tree or not, and the chain cut to ``chain`` tokens."""

    aux: bool
    chain: int

    def describe(self) -> str:
        parts = (["aux"] if self.aux else []) + ([f"chain {self.chain}"] if self.chain else [])
        return " + ".join(parts) or "none"


@dataclass(frozen=True)
class PolicyChoice:
    """The option chosen for every class (index: the class) at one context, with the cost model's prediction."""

    options: tuple[StepOption, ...]
    context: int
    expected_tokens: float  # per step, over the classes as often as the statistics saw them
    step_ms: float
    tokens_per_s: float
    baseline_tokens_per_s: float
    speedup_interval: tuple[float, float] | None = None  # the predicted speedup's 90% interval over the replicates

    def option(self, klass: int) -> StepOption:
        return self.options[min(klass, len(self.options) - 1)]

    def describe(self) -> dict:
        runs, start = [], 0  # classes with the same option as ranges: "2-5": "chain 11"
        for i in range(1, len(self.options) + 1):
            if i == len(self.options) or self.options[i] != self.options[start]:
                end = "+" if i == len(self.options) else (f"-{i - 1}" if i - 1 > start else "")
                runs.append((f"{start}{end}", self.options[start].describe()))
                start = i
        return {"context": self.context, "by_class": dict(runs), "expected_tokens": round(self.expected_tokens, 4),
                "step_ms": round(self.step_ms, 3), "predicted_tokens_per_s": round(self.tokens_per_s, 3),
                "predicted_speedup": round(self.tokens_per_s / self.baseline_tokens_per_s, 4),
                **_interval(self.speedup_interval)}


@dataclass(frozen=True)
class PolicyPlan:
    """One policy per context bucket, like :class:`TreePlan`'s trees."""

    choices: tuple[PolicyChoice, ...]
    bounds: tuple[int, ...] = ()
    sources: dict = field(default_factory=dict, compare=False)

    scores = 0  # the chain length a self-correcting policy (methods.online) needs scored at every step

    def option(self, context: int, klass: int) -> StepOption:
        return self.choices[bisect.bisect_right(self.bounds, context)].option(klass)

    def observe_cost(self, context: int, fed: int, seconds: float, share: float = 1.0) -> None:
        """A step's cost (a fixed policy learns nothing; methods.online's does); ``share`` as for a TreePlan."""

    def observe_scored(self, klass: int, chain: int, aux: int, context: int) -> None:
        """A step scored against its continuation: how deep the chain and the auxiliary draft were accepted."""

    def report(self) -> dict:
        return {}

    @cached_property
    def max_chain(self) -> int:
        """The longest chain any option verifies (read at every step: computed once)."""
        return max(o.chain for c in self.choices for o in c.options)

    def describe(self) -> dict:
        return {"buckets": [{"below": b, **c.describe()} for c, b in zip(self.choices, [*self.bounds, None])],
                "sources": self.sources}


ClassCounts = Mapping[int, Mapping[tuple[int, int], int]]  # class -> (chain depth, aux depth) -> steps


def best_policy(counts: ClassCounts, step_seconds: Callable[[int], float], aux_nodes: int, max_chain: int,
                context: int = 0, confidence: float = CONFIDENCE, rows: int = 1) -> PolicyChoice:
    """The option per class maximising tokens per second over all steps (Dinkelbach's method), then, class by
    class, the cheapest option that the best one does not beat by more than the uncertainty.

    The best ratio ``sum(n_c E_c) / sum(n_c T_c)`` over independent per-class options is found by choosing,
    for the current rate ``r``, every class's option maximising ``E - r T``, then updating ``r`` to the
    ratio this gives; the rate rises at every round and stops at the optimum. A step verifying ``L``
    chain tokens and an ``aux_nodes`` tree costs a step over ``1 + L + aux_nodes`` tokens (shared trie
    prefixes not subtracted); ``aux_nodes=0``: no auxiliary tree at this context. An option gives way to a
    cheaper one unless its ``E - r T`` is higher in ``confidence`` of the replicates: of the step times (where
    ``step_seconds`` has them) and of the two options' accepted tokens on the same steps (paired, from the
    class's counts). Where the whole policy does not beat drafting nothing, it drafts nothing.

    ``rows`` > 1 (a batch, ``step_seconds`` its step over that many rows): a step's block is the largest of its
    rows' (the engine pads every row's to it), so one row's long chain costs every row's step, and the classes are
    no longer independent. There the policy is chosen among the one above and, for every block size, the policies
    that keep every class within it (the above cut to it, or every class its most accepted option within it), by
    the step time of rows whose classes are drawn as often as the statistics saw them (:func:`batched_seconds`).
    """
    reps = _replicates(step_seconds)
    base, base_b = step_seconds(1), reps(1)
    noise = np.random.default_rng(0).standard_normal(REPLICATES)
    options = [StepOption(aux, length) for aux in ((False, True) if aux_nodes else (False,))
               for length in range(max_chain + 1)]
    chain = np.array([o.chain for o in options])[:, None]  # [options, 1]
    with_aux = np.array([o.aux for o in options])[:, None]
    size = [1 + o.chain + (aux_nodes if o.aux else 0) for o in options]
    seconds_v = np.array([step_seconds(q) for q in size])  # [options]
    seconds_bv = np.stack([np.broadcast_to(reps(q), base_b.shape) for q in size])  # [options, B]
    per_step, cells, weight = {}, {}, {}
    for klass, table in counts.items():
        c, a = (np.array([cell[i] for cell in table], dtype=float)[None, :] for i in (0, 1))
        per_step[klass] = 1 + np.maximum(np.minimum(c, chain), np.where(with_aux, a, 0))  # [options, cells]
        cells[klass] = np.array(list(table.values()), dtype=float)
        weight[klass] = float(cells[klass].sum())
    total = sum(weight.values())
    tokens_v = {k: per_step[k] @ cells[k] / weight[k] for k in counts}  # [options] per class
    rate, pick = 1 / base, {}
    for _ in range(100):  # the first option of the highest E - r T, the cheapest on a tie
        pick = {k: int(np.lexsort((seconds_v, -(tokens_v[k] - rate * seconds_v)))[0]) for k in counts}
        if not total:
            break
        expected = sum(weight[k] * tokens_v[k][o] for k, o in pick.items()) / total
        step = sum(weight[k] * seconds_v[o] for k, o in pick.items()) / total
        if expected / step <= rate * (1 + 1e-12):
            break
        rate = expected / step
    for klass, best in pick.items():
        # does `best` beat each cheaper option in the replicates? (the two on the same steps of this class: paired)
        diff = per_step[klass][best][None, :] - per_step[klass]  # [options, cells]
        mean = diff @ cells[klass] / weight[klass]
        sd = np.sqrt(np.maximum((diff - mean[:, None]) ** 2 @ cells[klass] / weight[klass], 0.0) / weight[klass])
        gain = mean[:, None] + noise[None, :] * sd[:, None] - rate * (seconds_bv[best][None, :] - seconds_bv)
        clearly = np.mean(gain > 0, axis=1) >= confidence
        cheaper = [o for o in np.argsort(seconds_v, kind="stable") if seconds_v[o] < seconds_v[best]]
        pick[klass] = next((int(o) for o in cheaper if not clearly[o]), best)
    freq = {k: w / total for k, w in weight.items()} if total else {}
    if rows > 1 and total:
        pick = _batch_pick(pick, freq, tokens_v, per_step, cells, weight, size, step_seconds, rows, noise, confidence)
    chosen = {k: options[o] for k, o in pick.items()}
    tokens = {(k, options[o]): float(tokens_v[k][o]) for k in counts for o in range(len(options))}
    shares = _shares(pick, freq, size)
    step = (float(batched_seconds(shares, step_seconds, rows)), batched_seconds(shares, reps, rows)) if total else \
        (base, base_b)
    return _policy_choice(chosen, weight, tokens, step, base, base_b, context, confidence)


def batched_seconds(shares: Mapping[int, float], seconds: Callable[[int], float | np.ndarray],
                    rows: int) -> float | np.ndarray:
    """The mean time of a step over ``rows`` rows whose blocks are drawn independently, ``shares`` being how often
    each block size is drawn, and whose step feeds the largest of them (the engine pads every row's block to it):
    ``sum_s T(s) (F(s)^rows - F(s-)^rows)``, ``F(s)`` the share of blocks of at most ``s`` (``rows=1``: the mean
    block's time). ``seconds``: a block's time, or its replicates."""
    total, below, out = sum(shares.values()), 0.0, 0.0
    for block in sorted(shares):
        upto = min(below + shares[block] / total, 1.0)
        out = out + seconds(block) * (upto ** rows - below ** rows)
        below = upto
    return out


def _shares(pick: Mapping[int, int], freq: Mapping[int, float], size: Sequence[int]) -> dict[int, float]:
    """Block size -> share of steps, for the option index per class ``pick``."""
    shares: dict[int, float] = defaultdict(float)
    for klass, option in pick.items():
        shares[size[option]] += freq[klass]
    return shares


def _batch_pick(pick: dict[int, int], freq: Mapping[int, float], tokens_v: Mapping[int, np.ndarray],
                per_step: Mapping[int, np.ndarray], cells: Mapping[int, np.ndarray], weight: Mapping[int, float],
                size: Sequence[int], step_seconds: Callable[[int], float], rows: int, noise: np.ndarray,
                confidence: float) -> dict[int, int]:
    """The option per class for a batch of ``rows`` rows (:func:`best_policy`): among the candidates, the cheapest
    one that the fastest does not beat in ``confidence`` of the replicates (step times and accepted tokens)."""
    candidates = [pick]
    for block in sorted(set(size)):
        within = [o for o in range(len(size)) if size[o] <= block]
        fill = {k: max(within, key=lambda o: (tokens_v[k][o], -size[o])) for k in pick}
        candidates += [fill, {k: o if size[o] <= block else fill[k] for k, o in pick.items()}]
    total = sum(weight.values())
    tokens, spread, seconds, seconds_b = [], [], [], []
    for candidate in candidates:
        mean = sum(freq[k] * tokens_v[k][o] for k, o in candidate.items())
        square = sum(per_step[k][o] ** 2 @ cells[k] for k, o in candidate.items()) / total
        tokens.append(mean)
        spread.append(math.sqrt(max(square - mean * mean, 0.0) / total))
        shares = _shares(candidate, freq, size)
        seconds.append(float(batched_seconds(shares, step_seconds, rows)))
        seconds_b.append(batched_seconds(shares, _replicates(step_seconds), rows))
    tokens_a, seconds_a = np.array(tokens), np.array(seconds)
    speed = tokens_a / seconds_a
    speed_b = np.maximum(tokens_a[:, None] + noise[None, :] * np.array(spread)[:, None], 1.0) / np.stack(seconds_b)
    fastest = int(np.argmax(speed))
    beaten = np.mean(speed_b[fastest][None, :] > speed_b, axis=1) >= confidence
    beaten[fastest] = False
    allowed = np.flatnonzero(~beaten)
    return candidates[int(allowed[np.lexsort((-speed[allowed], seconds_a[allowed]))[0]])]


def _policy_choice(chosen: dict, weight: dict, tokens: dict, step: tuple[float, np.ndarray], base: float,
                   base_b: np.ndarray, context: int, confidence: float) -> PolicyChoice:
    """The policy of ``chosen`` options with its prediction (``step``: its mean step time and its replicates);
    none at all where it does not beat drafting nothing."""
    total = sum(weight.values())
    none = StepOption(False, 0)
    expected = sum(weight[k] * tokens[k, o] for k, o in chosen.items()) / total if total else 1.0
    step, step_b = step
    speedup_b = expected / step_b * base_b
    if any(o != none for o in chosen.values()) and np.mean(speedup_b > 1) < confidence:
        chosen = dict.fromkeys(chosen, none)  # no gain beyond the noise: draft nothing
        expected, step, speedup_b = 1.0, base, np.ones_like(base_b)
    # a class never seen takes the option of the nearest seen class below it (a longer match is no worse)
    fallback, by_class = none, []
    for klass in range(MAX_CLASS + 1):
        fallback = chosen.get(klass, fallback)
        by_class.append(fallback)
    interval = tuple(float(v) for v in np.quantile(speedup_b, [0.05, 0.95]))
    return PolicyChoice(options=tuple(by_class), context=context, expected_tokens=expected, step_ms=1000 * step,
                        tokens_per_s=expected / step, baseline_tokens_per_s=1 / base, speedup_interval=interval)


def evaluate_policy(counts: ClassCounts, options: Sequence[StepOption], step_seconds: Callable[[int], float],
                    aux_nodes: int, context: int = 0, rows: int = 1) -> PolicyChoice:
    """What the cost model predicts for a given policy (the option per class, no search) under ``counts``: its
    tokens per step (per row) and the time of a step over ``rows`` rows (their largest block)."""
    tokens = total = 0.0
    shares: dict[int, float] = defaultdict(float)
    for klass, table in counts.items():
        option = options[min(klass, len(options) - 1)]
        aux = option.aux and aux_nodes > 0
        size = 1 + option.chain + (aux_nodes if aux else 0)
        for (c, a), n in table.items():
            tokens += n * (1 + max(min(c, option.chain), a if aux else 0))
            shares[size] += n
            total += n
    reps = _replicates(step_seconds)
    base, base_b = step_seconds(1), reps(1)
    expected = tokens / total if total else 1.0
    step, step_b = (float(batched_seconds(shares, step_seconds, rows)), batched_seconds(shares, reps, rows)) \
        if total else (base, base_b)
    interval = tuple(float(v) for v in np.quantile(expected / step_b * base_b, [0.05, 0.95]))
    return PolicyChoice(options=tuple(options), context=context, expected_tokens=expected, step_ms=1000 * step,
                        tokens_per_s=expected / step, baseline_tokens_per_s=1 / base, speedup_interval=interval)


def policy_speed(counts: ClassCounts, options: Sequence[StepOption], cost_at: Callable[[int], Callable[[int], float]],
                 contexts: Sequence[int], aux_nodes: Callable[[int], int], rows: int = 1) -> float:
    """Tokens per second of one policy over a run whose steps are at every one of ``contexts`` alike: its tokens
    over its seconds, each summed over the contexts."""
    return _summed_speed([evaluate_policy(counts, options, cost_at(c), aux_nodes(c), c, rows) for c in contexts])


def _summed_speed(predicted: Sequence[PolicyChoice]) -> float:
    """Tokens over milliseconds, each summed over the contexts of ``predicted``."""
    return sum(p.expected_tokens for p in predicted) / sum(p.step_ms for p in predicted)


def policy_plan(counts: ClassCounts, cost_at: Callable[[int], Callable[[int], float]], contexts: Sequence[int],
                aux_nodes: Callable[[int], int], max_chain: int, sources: dict | None = None,
                rows: int = 1) -> PolicyPlan:
    """A policy per calibrated context (``cost_at(context)``: the step cost there; the auxiliary tree's size
    there: ``aux_nodes(context)``; ``rows``: the batch's, whose step ``cost_at`` times).

    ``rows`` > 1: one policy for every context, as :func:`_one_tree` holds one tree: a step feeds the largest of
    its rows' blocks, so a policy that verifies chains at short contexts and none at long ones makes the long rows
    pay for the short rows' chains (SAM mode=auto ran 0.94x at 8 rows so, a quarter of its rows' steps verifying
    a chain). Of the policies the contexts chose, the one of the most tokens over seconds summed over the contexts
    (:func:`policy_speed`), the cheaper on a tie."""
    contexts = sorted(set(contexts))
    if not contexts:
        raise ValueError("a policy plan needs at least one calibrated context length")
    choices = [best_policy(counts, cost_at(c), aux_nodes(c), max_chain, c, rows=rows) for c in contexts]
    if rows > 1:
        scored = []
        for options in {choice.options for choice in choices}:
            predicted = [evaluate_policy(counts, options, cost_at(c), aux_nodes(c), c, rows) for c in contexts]
            scored.append((round(_summed_speed(predicted), 12), -sum(p.step_ms for p in predicted), predicted))
        choices = max(scored, key=lambda s: s[:2])[2]
    merged, kept = _buckets(contexts, choices, lambda choice: choice.options)
    return PolicyPlan(choices=merged, bounds=kept, sources=dict(sources or {}))
