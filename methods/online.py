"""Correction while a run goes: ``=auto`` plans re-chosen from the run's own steps.

A plan is chosen before the run from a device calibration and acceptance statistics collected on other
questions. Both can be off for this run: the machine runs slower or faster than when it was calibrated, a drafter
has its own per-step cost, and another workload accepts other nodes. The engine hands every step's wall time, the
size it fed and the accepted path to the drafter, which passes them here:

* **cost**: log(measured / calibrated) step time as a line in the fed size, fitted with a prior of a few steps
  at 0 (:class:`CostCorrection`): a factor on the calibrated cost of every size, those never fed included;
* **acceptance**: where the drafter scores the candidate tree in the shadow of every step (Token Recycling:
  :meth:`AdaptiveTreePlan.follow`), every node's share is the run's exact count, drafting or not, with the
  statistics as a prior of ``prior_steps`` steps; so a plan that stopped drafting on a bad first answer sees
  the next answers' acceptance and drafts again. Otherwise, per depth, the accepted nodes of the verified trees
  against what the statistics predicted for them, shrunk towards the factor of the depth above (towards 1 at
  depth 1) by the same prior: a factor on every candidate node's share at that depth;
* a few steps in many verify half the chosen tree (:attr:`AdaptiveTreePlan.probing`), so that the cost is seen at
  two sizes;
* every ``every`` (32) steps the plan is made anew from the corrected inputs (so with their uncertainty: the cheapest tree
  the fastest does not clearly beat); where its tree for the current context differs, it is taken if it is the
  cheaper one, or if it beats the current one under the corrected inputs by more than ``hysteresis``;
* in a batch (:mod:`methods.batch`) every row reports the shared step (``Step.rows``): the cadences above and the cost
  count steps of the batch, each row's acceptance counts as its own, and a plan holds one tree (one SAM policy) for
  every context (a step feeds the largest of its rows' blocks).

Only the tree changes, never the acceptance rule, so the output stays the baseline's. Every change is recorded
(step, context, trees, the corrections behind it) and reported with the turn (``Drafter.finish``).
"""

from __future__ import annotations

import bisect
import math
from collections import defaultdict
from typing import Callable, Sequence

import torch

from methods.costs import ContextCost
from methods.tree_search import (ClassCounts, DraftCost, NodeStats, PolicyPlan, RankPath, ShadowTree, TreePlan,
                                 best_policy, best_tree, evaluate, plan, policy_plan, policy_speed)


class CostCorrection:
    """Measured over calibrated step time as a function of the fed size ``q``: ``log(measured / calibrated) = a +
    b x + r_q`` with ``x = (q - 1) / 16``. ``a + b x`` is a ridge fit whose prior (0, 0) weighs as ``prior_steps``
    steps: a machine that runs slower overall moves ``a``, blocks that cost more than calibrated (or a drafter's own
    per-step cost, which weighs more on cheap steps) move ``b``, and sizes the run never fed are predicted from
    those it did. ``r_q``, a size's mean residual shrunk by the same prior, catches one size that the calibration
    got wrong (a lucky point). A size the run has timed many times is known from its own steps: :meth:`shrink`
    takes its share of the calibration's uncertainty away (the steps counted as independent; a machine that drifts
    during the run moves every size alike, which the comparison between sizes cancels)."""

    def __init__(self, prior_steps: float = 8.0):
        self.prior = prior_steps
        self.n = self.sx = self.sxx = self.sy = self.sxy = 0.0
        self.by_size: dict[int, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])  # per fed size: n, sum, squares

    @staticmethod
    def _x(fed: int) -> float:
        return (fed - 1) / 16

    def observe(self, fed: int, predicted: float, measured: float, weight: float = 1.0) -> None:
        """One step's time; ``weight``: the share of the step this observation is (each of a batch's B rows reports
        the same step: 1 / B), so that a step counts once however many rows report it."""
        if predicted > 0 and measured > 0:
            x, y = self._x(fed), math.log(measured / predicted)
            w = weight  # n counts steps (of the batch), not the rows that reported them
            self.n, self.sx, self.sxx, self.sy, self.sxy = (self.n + w, self.sx + w * x, self.sxx + w * x * x,
                                                            self.sy + w * y, self.sxy + w * x * y)
            own = self.by_size[fed]
            own[0], own[1], own[2] = own[0] + w, own[1] + w * y, own[2] + w * y * y

    def coefficients(self) -> tuple[float, float]:
        """(a, b) of the ridge fit."""
        a11, a12, a22 = self.n + self.prior, self.sx, self.sxx + self.prior
        det = a11 * a22 - a12 * a12
        return (a22 * self.sy - a12 * self.sxy) / det, (a11 * self.sxy - a12 * self.sy) / det

    def factor(self, fed: int) -> float:
        """The factor on a size's calibrated time."""
        a, b = self.coefficients()
        line = a + b * self._x(fed)
        n, total, _ = self.by_size.get(fed, (0, 0.0, 0.0))
        return math.exp(line + (total - n * line) / (n + self.prior))

    def shrink(self, fed: int, spread: float) -> float:
        """The calibration's standard error at a size (``spread``, in log time) combined with the run's mean over
        its ``n`` steps there (their variance ``v`` over ``n``), as a share of the calibration's: ``sqrt((v / n) /
        (v / n + spread**2))``; 1 for a size fed fewer than twice."""
        n, total, squares = self.by_size.get(fed, (0, 0.0, 0.0))
        if n < 2 - 1e-9 or spread <= 0:
            return 1.0
        variance = max(squares - total * total / n, 0.0) / (n - 1)
        return math.sqrt(variance / (variance + n * spread * spread))

    def describe(self) -> dict:
        return {"by_fed_size": {str(q): round(self.factor(q), 4) for q in sorted(self.by_size)},
                "steps_by_fed_size": {str(q): round(own[0], 2) for q, own in sorted(self.by_size.items())}}


CostAt = Callable[[int, CostCorrection | None], ContextCost]  # (context, the run's correction) -> the cost there


class AdaptiveTreePlan:
    """A :class:`TreePlan` (what drafters read: :meth:`index`, :attr:`trees`, :attr:`version`) made offline and
    re-made from the run's own steps (:meth:`observe`)."""

    def __init__(self, stats: NodeStats, cost_at: CostAt, contexts: Sequence[int], sources: dict | None = None,
                 draft: Callable[[int], DraftCost] | None = None, every: int = 32, prior_steps: float = 32.0,
                 hysteresis: float = 0.02, probe: tuple[int, int] = (2, 128), memory: float = 512.0, rows: int = 1):
        self.stats, self.cost_at, self.contexts, self.draft = stats, cost_at, tuple(contexts), draft
        self.every, self.prior, self.hysteresis, self.probe = every, prior_steps, hysteresis, probe
        self.rows = rows  # a batch's: one tree for every context (a step feeds the largest of its rows' trees)
        self.initial = self.plan = plan(stats, lambda c: cost_at(c, None), contexts, sources=sources, draft=draft,
                                        rows=rows)
        self.sources = self.initial.sources
        self.cost = CostCorrection()
        self.accepted: dict[int, float] = defaultdict(float)  # per depth: accepted nodes of the verified trees
        self.predicted: dict[int, float] = defaultdict(float)  # per depth: what the statistics predicted for them
        self.verified: dict[int, int] = defaultdict(int)  # per depth: steps whose tree reached it
        self.steps = self.drafting = 0  # the rows' steps (a batch's step counts once per row)
        self.elapsed = self._replanned = 0.0  # the steps of the batch (of the one sequence at batch size 1)
        self.shadows: list[ShadowTree] = []  # candidate trees scored beside every step (one per row of a batch)
        self._proposals = 0  # the rows' propose calls so far (which of them scores its shadow: scores())
        self.memory = memory
        self.evidence: dict[RankPath, float] = {}  # per candidate node: the shadows' fading count of its acceptance
        self.evidence_steps = 0.0  # the fading count of the steps they scored
        self._seen: tuple[list[int], int] = ([], 0)  # the shadows' counts when last absorbed
        self.version = 0
        self.changes: list[dict] = []
        self._reported = 0

    # what a drafter reads, as of a TreePlan
    def index(self, context: int) -> int:
        return self.plan.index(context)

    @property
    def probing(self) -> bool:
        """``probe[0]`` steps of every ``probe[1]`` verify another tree than the chosen one: half of it, or where it
        is smaller than two nodes the two most accepted nodes. Steps of one size alone cannot tell a machine that
        runs slower overall from blocks that cost more than calibrated, and a plan that drafts nothing would never
        see the acceptance that could make it draft again."""
        steps = int(self.elapsed + 1e-6)  # of the batch: a probe step verifies the probe tree in every row
        return steps >= self.probe[1] and steps % self.probe[1] < self.probe[0]

    @property
    def trees(self) -> list[tuple[RankPath, ...]]:
        trees = self.plan.trees
        if not self.probing:
            return trees
        small = tuple(sorted((p for p, _ in self.stats.ranked()[:2]), key=lambda p: (len(p), p)))
        return [tree[: len(tree) // 2] if len(tree) >= 2 else small for tree in trees]

    def describe(self) -> dict:
        return self.initial.describe()

    def observe(self, context: int, fed: int, seconds: float, ranks: Sequence[int], share: float = 1.0) -> None:
        """One step at ``context`` (prompt + output before it) that fed ``fed`` tokens, took ``seconds`` and
        accepted the draft nodes of sibling ranks ``ranks`` (by depth) from the tree the plan gave there.
        ``share``: 1 / the rows of a batch that verified the step: each row's acceptance is its own, but the step's
        time is counted once, and the plan is re-made every ``every`` steps of the batch, not of each row (a
        re-plan costs milliseconds: at 8 rows, every 32 rows' steps made it about 2% of a step, as profiled)."""
        tree = self.trees[self.plan.index(context)]
        self.cost.observe(fed, self.cost_at(context, None).curve.seconds(fed, context), seconds, share)
        self.steps += 1
        self.elapsed += share
        if tree:
            self.drafting += 1
            for path in tree:
                self.predicted[len(path)] += self.stats.probs.get(path, 0.0)
            for depth in range(1, max(map(len, tree)) + 1):
                self.verified[depth] += 1
            for depth in range(1, len(ranks) + 1):
                self.accepted[depth] += 1
        if self.elapsed >= self._replanned + self.every - 1e-9:
            self._replanned = self.elapsed
            self._replan(context)

    def follow(self, shadow: ShadowTree) -> None:
        """Take the exact acceptance of every node of ``shadow`` (the candidate tree, scored at every step) instead
        of the verified trees' acceptance by depth."""
        self.shadows.append(shadow)

    def scores(self) -> bool:
        """Whether the row proposing now scores its shadow: every row at batch size 1; at B rows one proposal in
        B + 1 (the row scored moves from step to step), so that a step's shadow work (filling and scoring the
        candidate tree) does not grow with the batch, nor the evidence per second."""
        self._proposals += 1
        return self.rows == 1 or self._proposals % (self.rows + 1) == 0

    def _absorb(self) -> None:
        """Add the followed shadows' counts since the last call to the run's evidence, older evidence fading with
        a half-life of ``memory`` steps: a run moves between kinds of questions (Spec-Bench's groups accept from
        1.5 to 1.9 tokens a step with one tree), and the plan follows the questions it is answering now."""
        counts = torch.stack([shadow.run_counts for shadow in self.shadows]).sum(0).tolist()  # one host copy
        steps = sum(shadow.run_steps for shadow in self.shadows)
        new_counts = [n - m for n, m in zip(counts, self._seen[0] or [0] * len(counts))]
        new_steps = steps - self._seen[1]
        fade = 0.5 ** (new_steps / self.memory)
        for path, n in zip(self.shadows[0].paths, new_counts):
            self.evidence[path] = fade * self.evidence.get(path, 0.0) + n
        self.evidence_steps = fade * self.evidence_steps + new_steps
        self._seen = (counts, steps)

    def corrected(self) -> NodeStats:
        """The statistics corrected by the run: from the shadow's (fading) counts where one is followed, the
        statistics weighing as ``prior_steps`` steps; else with the run's acceptance factors per depth (capped by
        the parent, at most 1)."""
        if self.shadows:
            steps = self.evidence_steps
            probs = {path: (self.prior * p + self.evidence.get(path, 0.0)) / (self.prior + steps)
                     for path, p in self.stats.probs.items()}
            return NodeStats(probs, self.stats.draft_rate, self.stats.steps + round(steps))
        factors = self.depth_factors()
        deepest = max(factors, default=0)
        probs: dict[RankPath, float] = {}
        for path in sorted(self.stats.probs, key=len):
            p = self.stats.probs[path] * factors.get(min(len(path), deepest), 1.0)
            probs[path] = min(p, probs.get(path[:-1], 1.0))
        rate = (self.drafting + self.prior * self.stats.draft_rate) / (self.steps + self.prior) \
            if self.stats.draft_rate < 1 else 1.0
        return NodeStats(probs, rate, self.stats.steps + self.drafting)

    def depth_factors(self) -> dict[int, float]:
        """Per observed depth: (accepted + prior x centre) / (predicted + prior), the prior being ``prior_steps``
        steps' worth of the prediction at that depth, its centre the factor of the depth above (1 at depth 1): a
        depth seen for a few steps only keeps close to the depth above rather than to the statistics. Following a
        shadow: the corrected over the offline acceptance of the candidate's nodes at that depth (what is recorded)."""
        if self.shadows:
            corrected, by_depth = self.corrected().probs, defaultdict(lambda: [0.0, 0.0])
            for path, p in self.stats.probs.items():
                by_depth[len(path)][0] += corrected[path]
                by_depth[len(path)][1] += p
            return {d: c / p for d, (c, p) in sorted(by_depth.items()) if p > 0}
        factors, centre = {}, 1.0
        for depth in sorted(self.predicted):
            predicted = self.predicted[depth]
            if predicted > 0:
                prior = self.prior * predicted / self.verified[depth]
                centre = factors[depth] = (self.accepted[depth] + prior * centre) / (predicted + prior)
        return factors

    def _speed(self, stats: NodeStats, tree: Sequence[RankPath], cost: ContextCost, context: int) -> float:
        """Expected tokens per second of ``tree`` under ``stats`` and ``cost``."""
        return evaluate(stats, tree, cost.seconds, context, self.draft(context) if self.draft else None).tokens_per_s

    def _replan(self, context: int) -> None:
        """Choose again at this context's calibrated length (the plan's bucket here); only where that differs from
        the tree in use and is to be taken, make the whole plan anew (every bucket) from the corrected inputs."""
        if self.shadows:
            self._absorb()
        stats = self.corrected()
        cost_at = lambda c: self.cost_at(c, self.cost)  # noqa: E731 -- the corrected cost, per context
        fresh = None
        if self.rows > 1:  # one tree for every context (tree_search._one_tree): the whole plan is the choice
            fresh = plan(stats, cost_at, self.contexts, sources=self.sources, draft=self.draft, rows=self.rows)
            new_tree = fresh.trees[fresh.index(context)]
        else:  # this context's calibrated length first; the whole plan only where its tree is to change
            here = min(self.contexts, key=lambda c: abs(math.log(c / max(context, 1))))
            new_tree = best_tree(stats, cost_at(here), None, here, self.draft(here) if self.draft else None).paths
        old_tree = self.plan.trees[self.plan.index(context)]
        if new_tree == old_tree:
            return
        cost = cost_at(context)
        gain = self._speed(stats, new_tree, cost, context) / self._speed(stats, old_tree, cost, context) - 1
        if cost.seconds(len(new_tree) + 1) >= cost.seconds(len(old_tree) + 1) and gain <= self.hysteresis:
            return  # a dearer tree must win by more than the hysteresis; a cheaper one the planner prefers is taken
        self.plan = fresh if fresh is not None else plan(stats, cost_at, self.contexts, sources=self.sources,
                                                         draft=self.draft)
        self.version += 1
        self.changes.append({"step": self.steps, "context": context, "from_nodes": len(old_tree),
                             "to_nodes": len(new_tree), "to": [list(p) for p in new_tree],
                             "predicted_gain": round(gain, 4),
                             "acceptance_by_depth": {str(d): round(f, 4) for d, f in sorted(self.depth_factors().items())},
                             **({"shadow_steps": round(self.evidence_steps)} if self.shadows else {}),
                             "cost": self.cost.describe()})

    def report(self) -> dict:
        """The plan changes since the last report (one turn's), for the turn's record."""
        changes, self._reported = self.changes[self._reported:], len(self.changes)
        return {"plan_changes": changes, "plan_version": self.version}


class AdaptivePolicyPlan:
    """A :class:`PolicyPlan` (what SAM reads: :meth:`option`, :attr:`max_chain`) re-made from the run's own scored
    steps, which SAM scores exactly (how deep its chain and its fallback would have been accepted), and costs."""

    def __init__(self, counts: ClassCounts, cost_at: CostAt, contexts: Sequence[int], aux_nodes: Callable[[int], int],
                 max_chain: int, sources: dict | None = None, every: int = 32, prior_steps: float = 64.0,
                 hysteresis: float = 0.02, rows: int = 1):
        self.counts = {k: dict(t) for k, t in counts.items()}
        total = sum(sum(t.values()) for t in self.counts.values())
        self.weight = min(1.0, prior_steps / total) if total else 1.0  # the offline counts as ``prior_steps`` steps
        self.cost_at, self.contexts, self.aux_nodes, self.chain_limit = cost_at, tuple(contexts), aux_nodes, max_chain
        self.every, self.hysteresis, self.rows = every, hysteresis, rows  # a batch's rows: its block is their largest
        self.initial = self.plan = policy_plan(counts, lambda c: cost_at(c, None), contexts, aux_nodes, max_chain,
                                               sources, rows)
        self.sources = self.initial.sources
        self.cost = CostCorrection()
        self.run: dict[int, dict[tuple[int, int], int]] = defaultdict(lambda: defaultdict(int))
        self.steps, self.version, self.changes, self._reported = 0.0, 0, [], 0  # steps of the batch
        self.scores = max_chain  # SAM scores its chain up to this length at every step, for observe_scored
        self._replanned = 0.0  # the step of the last re-plan

    def option(self, context: int, klass: int):
        return self.plan.option(context, klass)

    @property
    def max_chain(self) -> int:
        """The longest chain the current plan verifies (SAM retrieves at least the scored length anyway)."""
        return self.plan.max_chain

    def describe(self) -> dict:
        return self.initial.describe()

    def observe_cost(self, context: int, fed: int, seconds: float, share: float = 1.0) -> None:
        """A step's cost; ``share`` as for :meth:`AdaptiveTreePlan.observe` (the step counted once; re-planned every
        ``every`` steps of the batch)."""
        self.cost.observe(fed, self.cost_at(context, None).curve.seconds(fed, context), seconds, share)
        self.steps += share

    def observe_scored(self, klass: int, chain: int, aux: int, context: int) -> None:
        """One step scored once its continuation was known (SAM's ``score``)."""
        self.run[klass][chain, aux] += 1
        if self.steps >= self._replanned + self.every - 1e-9:
            self._replan(context)

    def _replan(self, context: int) -> None:
        """Choose again at this context's calibrated length; only where that differs from the policy in use and is
        to be taken, make the whole plan anew from the offline and the run's counts. In a batch the whole plan is
        the choice (one policy for every context: :func:`methods.tree_search.policy_plan`)."""
        self._replanned = self.steps
        counts: dict[int, dict[tuple[int, int], float]] = defaultdict(lambda: defaultdict(float))
        for source, weight in ((self.counts, self.weight), (self.run, 1.0)):
            for klass, table in source.items():
                for cell, n in table.items():
                    counts[klass][cell] += weight * n
        cost_at = lambda c: self.cost_at(c, self.cost)  # noqa: E731
        fresh = None
        if self.rows > 1:
            fresh = policy_plan(counts, cost_at, self.contexts, self.aux_nodes, self.chain_limit, self.sources,
                                self.rows)
            new_choice, over = fresh.choices[0], self.contexts
        else:
            here = min(self.contexts, key=lambda c: abs(math.log(c / max(context, 1))))
            new_choice, over = best_policy(counts, cost_at(here), self.aux_nodes(here), self.chain_limit, here), (here,)
        new_options, old_options = new_choice.options, self.plan.choices[_bucket(self.plan, context)].options
        if new_options == old_options:
            return
        gain = policy_speed(counts, new_options, cost_at, over, self.aux_nodes, self.rows) / \
            policy_speed(counts, old_options, cost_at, over, self.aux_nodes, self.rows) - 1
        if gain <= self.hysteresis:
            return
        self.plan = fresh if fresh is not None else policy_plan(counts, cost_at, self.contexts, self.aux_nodes,
                                                                self.chain_limit, self.sources)
        self.version += 1
        self.changes.append({"step": round(self.steps, 2), "context": context, "to": new_choice.describe()["by_class"],
                             "predicted_gain": round(gain, 4), "cost": self.cost.describe()})

    def report(self) -> dict:
        changes, self._reported = self.changes[self._reported:], len(self.changes)
        return {"plan_changes": changes, "plan_version": self.version}


def _bucket(plan: PolicyPlan | TreePlan, context: int) -> int:
    return bisect.bisect_right(plan.bounds, context)

