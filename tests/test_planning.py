"""Plans that do not chase noise, and plans that correct themselves while a run goes (methods.costs,
methods.tree_search, methods.online), on synthetic cost curves and acceptance processes."""

from __future__ import annotations

import random

import torch

from conftest import VOCAB, tiny_llama
from methods.costs import CostCurve
from methods.drafter import Drafter
from methods.engine import Engine
from methods.online import AdaptivePolicyPlan, AdaptiveTreePlan, CostCorrection
from methods.recycling import TokenRecycling
from methods.tree_search import (NodeStats, StepOption, batched_seconds, best_policy, best_tree, evaluate, plan,
                                 policy_plan, policy_speed)

SIZES = tuple(range(1, 17))
CONTEXTS = (128, 512)


def step_ms(q: int, context: int) -> float:
    """A step's true time: 60 ms, 2 ms more per token, 10% more at the longer context."""
    return (60 + 2 * (q - 1)) * (1 + 0.1 * (context == 512))


def noisy_curve(lucky: int | None = None, spread: float = 0.2, repeats: int = 5, step=step_ms) -> CostCurve:
    """Every point timed ``repeats`` times within +/- ``spread``; the ``lucky`` size's repeats all came out 10% low
    (its median too), as one lucky point of a real calibration does."""
    rng = random.Random(0)
    samples = []
    for c in CONTEXTS:
        row = []
        for q in SIZES:
            luck = 0.88 if q == lucky else 1.0  # 12% fast: as far below its neighbours as the trees differ
            row.append([step(q, c) * luck * (1 + rng.uniform(-spread, spread)) for _ in range(repeats)])
        samples.append(row)
    return CostCurve.from_samples(CONTEXTS, SIZES, samples)


# acceptance: a chain-like tree, each node half as likely as its parent, ranks falling off
PROBS = {(0,): 0.6, (1,): 0.15, (0, 0): 0.38, (0, 1): 0.08, (1, 0): 0.07, (0, 0, 0): 0.25, (0, 0, 1): 0.05,
         (0, 0, 0, 0): 0.16, (0, 0, 0, 0, 0): 0.1, (0, 0, 0, 0, 0, 0): 0.065, (0, 0, 0, 0, 0, 0, 0): 0.045,
         (0, 0, 0, 0, 0, 0, 0, 0): 0.04, (0, 0, 0, 0, 0, 0, 0, 0, 0): 0.035, (2,): 0.03, (0, 2): 0.02}


def test_a_lucky_point_does_not_become_the_padding_size():
    honest, lucky = noisy_curve(), noisy_curve(lucky=12)
    assert lucky.pad_table(128, confidence=0.0)[10] == 12  # the means say: feed 10 tokens as 12
    assert lucky.interval(12, 128)[1] > 0.95 * lucky.seconds(10, 128)  # but 12's interval reaches past the gain
    assert lucky.pad_table(128)[9:12] == (9, 10, 11)  # so nothing is padded to the lucky 12
    assert honest.pad_table(128) == tuple(range(17))


def test_a_lucky_point_does_not_decide_the_tree():
    stats = NodeStats(PROBS)
    lucky = noisy_curve(lucky=12).at(128)
    naive = best_tree(stats, lucky, confidence=0.0)  # the fastest by the medians alone
    robust = best_tree(stats, lucky)
    assert naive.n_nodes == 11  # the lucky 12-token step decides the naive choice
    assert robust.n_nodes < 11
    truth = best_tree(stats, lambda q: step_ms(q, 128) / 1000)  # the tree the true curve calls best

    def speed(tree):  # tokens per second on the true curve
        return (1 + sum(PROBS[p] for p in tree)) / step_ms(len(tree) + 1, 128)
    assert speed(robust.paths) >= 0.98 * speed(truth.paths) > speed(naive.paths) * 0.98
    assert robust.speedup_interval[0] <= robust.tokens_per_s / robust.baseline_tokens_per_s <= robust.speedup_interval[1]


def test_where_no_tree_clearly_pays_the_plan_drafts_nothing_and_says_so():
    stats = NodeStats({(0,): 0.04, (0, 0): 0.01})  # a node that pays 4% for a 6% dearer step: lost in the noise
    choice = best_tree(stats, noisy_curve(spread=0.2).at(128))
    assert choice.paths == () and choice.describe()["beyond_noise"] is False
    sure = best_tree(NodeStats({(0,): 0.9, (0, 0): 0.8}), noisy_curve(spread=0.02).at(128))
    assert sure.n_nodes == 2 and sure.describe()["beyond_noise"] is True


def test_a_policy_option_wins_only_beyond_the_noise():
    counts = {0: {(0, 0): 900, (1, 0): 40}, 8: {(6, 0): 200, (2, 0): 20}}  # class 0 barely gains from a chain
    noisy = noisy_curve(spread=0.2).at(128)
    policy = best_policy(counts, noisy, aux_nodes=0, max_chain=8)
    assert policy.option(0) == StepOption(False, 0)  # not worth a dearer step
    assert policy.option(8).chain >= 4  # a long match pays beyond doubt
    naive = best_policy(counts, noisy, aux_nodes=0, max_chain=8, confidence=0.0)
    assert naive.tokens_per_s >= policy.tokens_per_s * 0.99  # the cheaper choice costs (almost) nothing


def test_a_batch_pays_for_its_longest_row_so_a_policy_for_eight_rows_cuts_its_long_chains():
    """One row's long chain makes every row's step a long one (the engine pads every block to the largest): a
    policy chosen as if every row paid for its own block lost 27% at 8 rows. 20% of steps match long spans that
    accept 12 tokens; the rest accept nothing."""
    counts = {0: {(0, 0): 800}, 8: {(12, 0): 200}}
    cost = lambda q: (60 + 20 * (q - 1)) / 1000  # noqa: E731 -- a step over the batch's rows
    one, two, eight = (best_policy(counts, cost, aux_nodes=0, max_chain=12, rows=rows) for rows in (1, 2, 8))
    assert one.option(8).chain == 12 and two.option(8).chain == 12  # 1 or 2 rows: the long chain pays
    assert all(o.chain == 0 for o in eight.options)  # 8 rows: 83% of steps would pay for a 13-token block
    as_if_alone = policy_speed(counts, one.options, lambda c: cost, (0,), lambda c: 0, rows=8)
    assert as_if_alone < 0.8 * eight.tokens_per_s  # the policy chosen as for one row loses there
    rng = random.Random(6)  # the mean step of 8 rows whose classes are drawn as the counts say: the largest block's
    drawn = [max(13 if rng.random() < 0.2 else 1 for _ in range(8)) for _ in range(20000)]
    assert abs(batched_seconds({1: 0.8, 13: 0.2}, cost, 8) / (sum(map(cost, drawn)) / len(drawn)) - 1) < 0.01


class Process:
    """A synthetic run: the true acceptance shares and a true step cost; draws each step's accepted path through
    the verified tree."""

    def __init__(self, probs: dict, cost, seed: int = 0):
        self.probs, self.cost, self.rng = probs, cost, random.Random(seed)

    def accepted(self, tree: tuple) -> list[int]:
        """The accepted ranks: at each depth the true continuation is a child with its conditional share."""
        path: tuple = ()
        while True:
            children = [p for p in self.probs if len(p) == len(path) + 1 and p[:-1] == path]
            parent = self.probs.get(path, 1.0)
            draw, chosen = self.rng.random(), None
            for child in children:
                draw -= self.probs[child] / parent
                if draw < 0:
                    chosen = child
                    break
            if chosen is None or chosen not in tree:
                return list(path)
            path = chosen

    def run(self, online: AdaptiveTreePlan, steps: int, context: int = 200) -> tuple:
        for _ in range(steps):
            tree = online.trees[online.index(context)]
            fed = len(tree) + 1
            online.observe(context, fed, self.cost(fed), self.accepted(tree))
        return online.trees[online.index(context)]

    def speed(self, tree: tuple) -> float:
        return (1 + sum(self.probs.get(p, 0.0) for p in tree)) / self.cost(len(tree) + 1)


def steep_ms(q: int, context: int) -> float:
    """A step that grows 6 ms a token: trees of different sizes differ clearly."""
    return 60 + 6 * (q - 1)


def test_online_correction_converges_to_the_best_fixed_tree_from_wrong_statistics():
    truth = Process(PROBS, lambda q: 1.25 * steep_ms(q, 128) / 1000)  # a machine 25% slower than calibrated
    curve = noisy_curve(spread=0.02, step=steep_ms)
    best = best_tree(NodeStats(PROBS), truth.cost).paths  # the best fixed tree, knowing the truth
    deep = {(0,) * d: 0.95 ** d for d in range(1, 10)}  # statistics from a workload that copies long spans
    for wrong, name in ((NodeStats(deep, steps=400), "flattering"),
                        (NodeStats({p: 0.3 * v for p, v in PROBS.items()}, steps=400), "pessimistic")):
        online = AdaptiveTreePlan(wrong, lambda c, correction=None: curve.at(c, None, correction), CONTEXTS, every=16)
        first = online.trees[online.index(200)]
        final = truth.run(online, 3000)
        assert truth.speed(first) < 0.97 * truth.speed(best), name  # the wrong statistics started it elsewhere
        assert truth.speed(final) >= 0.98 * truth.speed(best), name
        assert online.version >= 1 and online.report()["plan_changes"] and not online.report()["plan_changes"]


def test_online_correction_learns_that_blocks_cost_more_than_calibrated():
    """The drafter's own per-step cost and a dearer large block (a CPU's caches): the plan shrinks its tree."""
    truth = Process(PROBS, lambda q: (steep_ms(q, 128) + 8 * (q - 1)) / 1000 * 1.1)
    curve = noisy_curve(spread=0.02, step=steep_ms)
    online = AdaptiveTreePlan(NodeStats(PROBS, steps=400), lambda c, correction=None: curve.at(c, None, correction), CONTEXTS)
    best = best_tree(NodeStats(PROBS), truth.cost).paths
    first, final = online.trees[online.index(200)], truth.run(online, 2000)
    assert len(first) > len(best) and truth.speed(final) >= 0.98 * truth.speed(best)
    assert online.changes[-1]["cost"]["by_fed_size"]


def test_online_policy_correction_learns_the_runs_own_match_lengths():
    prior = {0: {(0, 0): 100}, 8: {(0, 0): 100}}  # the statistics saw long matches that never continued
    curve = noisy_curve(spread=0.02)
    online = AdaptivePolicyPlan(prior, lambda c, correction=None: curve.at(c, None, correction), CONTEXTS,
                                aux_nodes=lambda c: 0, max_chain=8, every=16)
    assert online.option(200, 8).chain == 0
    for step in range(400):  # in this run they do: class 8 accepts 6 copied tokens
        online.observe_cost(200, 7, step_ms(7, 128) / 1000)
        online.observe_scored(8, 6, 0, 200)
    assert online.option(200, 8).chain >= 6 and online.option(200, 0).chain == 0


class Shadow:
    """What a drafter's shadow of the candidate tree hands a plan it follows: every node's acceptance, every step."""

    def __init__(self, paths):
        self.paths, self.run_counts, self.run_steps = tuple(paths), torch.zeros(len(paths), dtype=torch.long), 0

    def score(self, accepted: list[int]) -> None:
        for depth in range(1, len(accepted) + 1):
            self.run_counts[self.paths.index(tuple(accepted[:depth]))] += 1
        self.run_steps += 1


def test_a_plan_that_stopped_drafting_on_a_bad_start_drafts_again_from_its_shadow():
    """A run whose first answers accept a tenth of what the statistics say stops drafting; later answers accept
    what they say. Following a shadow (every node scored at every step, drafting or not), the plan drafts again
    and ends at the best fixed tree; and its memory fades, so it follows the questions it answers now."""
    curve = noisy_curve(spread=0.02, step=steep_ms)
    cost = lambda q: steep_ms(q, 128) / 1000  # noqa: E731
    bad, good = Process({p: 0.1 * v for p, v in PROBS.items()}, cost, seed=1), Process(PROBS, cost, seed=2)
    best = best_tree(NodeStats(PROBS), cost).paths
    online = AdaptiveTreePlan(NodeStats(PROBS, steps=400), lambda c, correction=None: curve.at(c, None, correction), CONTEXTS,
                              every=16, memory=256)
    shadow = Shadow(PROBS)
    online.follow(shadow)
    for process, steps in ((bad, 600), (good, 1500)):
        for _ in range(steps):
            tree = online.trees[online.index(200)]
            shadow.score(process.accepted(tuple(PROBS)))
            online.observe(200, len(tree) + 1, process.cost(len(tree) + 1), process.accepted(tree))
        if process is bad:
            assert online.trees[online.index(200)] == ()  # nothing pays while a tenth is accepted
    assert good.speed(online.trees[online.index(200)]) >= 0.98 * good.speed(best)
    assert online.changes[-1]["shadow_steps"] < 1500  # older evidence faded


def test_a_gain_the_run_keeps_measuring_is_taken_though_the_calibration_could_not_tell_it():
    """A calibration too noisy to tell a 6% gain (the plan drafts nothing: the cheaper choice within the noise);
    the run times its own steps (a few percent of noise each) and the shadow scores the acceptance. Once the run
    has timed the sizes it compares, their cost is its own, not the calibration's, and the plan drafts."""
    probs = {(0,): 0.1, (0, 0): 0.03, (1,): 0.01}
    rng = random.Random(3)
    cost = lambda q: step_ms(q, 128) / 1000  # noqa: E731
    noisy = lambda q: cost(q) * (1 + rng.uniform(-0.03, 0.03))  # noqa: E731 -- a run's step times
    truth = Process(probs, noisy, seed=4)
    best = best_tree(NodeStats(probs), cost).paths
    curve = noisy_curve(spread=0.2)
    online = AdaptiveTreePlan(NodeStats(probs, steps=2000), lambda c, correction=None: curve.at(c, None, correction),
                              CONTEXTS, every=16)
    assert best and online.trees[online.index(200)] == ()  # a gain the calibration cannot tell from noise
    shadow = Shadow(probs)
    online.follow(shadow)
    for _ in range(3000):
        tree = online.trees[online.index(200)]
        shadow.score(truth.accepted(tuple(probs)))
        online.observe(200, len(tree) + 1, noisy(len(tree) + 1), truth.accepted(tree))
    final = online.trees[online.index(200)]
    exact_speed = lambda tree: (1 + sum(probs.get(p, 0.0) for p in tree)) / cost(len(tree) + 1)  # noqa: E731
    assert exact_speed(final) >= 0.98 * exact_speed(best)


def test_the_runs_own_steps_narrow_a_sizes_cost_only_as_far_as_they_agree():
    rng = random.Random(5)
    steady, erratic = CostCorrection(), CostCorrection()
    for _ in range(200):
        steady.observe(5, 0.080, 0.080 * (1 + rng.uniform(-0.01, 0.01)))
    for _ in range(3):
        erratic.observe(5, 0.080, 0.080 * (1 + rng.uniform(-0.3, 0.3)))
    assert steady.shrink(5, 0.03) < 0.05  # 200 steps within 1%: the calibration's +/-3% barely counts
    assert erratic.shrink(5, 0.03) > 0.8 and steady.shrink(9, 0.03) == 1.0  # three erratic steps, or none


def test_a_batch_step_that_every_row_reports_counts_once():
    """B rows report the same step (its fed size and seconds): the cost correction, its precision, the re-plan and
    probe cadences are those of one step, not of B independent ones (which would take the calibration's uncertainty
    away sqrt(B) times too fast, re-plan and probe B times as often); and about one row a step scores the shadow."""
    rng = random.Random(7)
    times = [0.080 * (1 + rng.uniform(-0.05, 0.05)) for _ in range(40)]
    alone, batch = CostCorrection(), CostCorrection()
    for t in times:
        alone.observe(5, 0.080, t)
        for _ in range(8):
            batch.observe(5, 0.080, t, 1 / 8)
    assert abs(batch.factor(5) - alone.factor(5)) < 1e-9 and abs(batch.shrink(5, 0.03) - alone.shrink(5, 0.03)) < 1e-9

    curve = noisy_curve(spread=0.02, step=steep_ms)
    for rows in (1, 8):
        plan = AdaptiveTreePlan(NodeStats(PROBS, steps=400), lambda c, correction=None: curve.at(c, None, correction),
                                CONTEXTS, every=16, rows=rows)
        replans: list[int] = []
        plan._replan = replans.append  # count the re-plans (each takes milliseconds)
        probes = scored = 0
        for _ in range(300):  # 300 steps of the batch, each proposed and reported by every row
            probes += plan.probing
            scored += sum(plan.scores() for _ in range(rows))
            for _ in range(rows):
                plan.observe(200, 1, steep_ms(1, 128) / 1000, [], 1 / rows)
        assert len(replans) == 18 and plan.steps == rows * 300
        assert probes == 4  # steps 128, 129, 256, 257 of the batch: a probe feeds every row's probe tree
        assert scored == (300 if rows == 1 else 300 * 8 // 9)  # a step's shadow work does not grow with the rows
    policy = AdaptivePolicyPlan({0: {(0, 0): 100}}, lambda c, correction=None: curve.at(c, None, correction), CONTEXTS,
                                aux_nodes=lambda c: 0, max_chain=8, every=16, rows=8)
    for _ in range(160 * 8):
        policy.observe_cost(200, 1, steep_ms(1, 128) / 1000, 1 / 8)
    assert policy.steps == 160 and policy.cost.describe()["steps_by_fed_size"] == {"1": 160}


def test_a_batch_drafts_one_tree_at_every_context_since_a_step_feeds_its_rows_largest():
    """Alone, a sequence drafts a tree at a short context and none at a long one. Rows at both contexts share a step
    that feeds the larger block, so at 8 rows the plan holds one tree for every context: of the trees the contexts
    chose, the one of more tokens over seconds summed over the contexts (here none: the long context would pay 60 ms
    a node, the short one saves less than that)."""
    stats = NodeStats(PROBS, steps=400)
    cost_at = lambda c: (lambda q: (60 + (2 if c == 128 else 60) * (q - 1)) / 1000)  # noqa: E731
    alone = plan(stats, cost_at, CONTEXTS)
    assert alone.trees[alone.index(100)] and not alone.trees[alone.index(1000)]
    batch = plan(stats, cost_at, CONTEXTS, rows=8)
    assert len(batch.trees) == 1

    def speed(tree):
        predicted = [evaluate(stats, tree, cost_at(c), c) for c in CONTEXTS]
        return sum(p.expected_tokens for p in predicted) / sum(p.step_ms for p in predicted)

    assert batch.trees[0] == max(alone.trees, key=lambda t: (speed(t), -len(t))) == ()
    cheap = plan(stats, lambda c: (lambda q: (60 + (2 if c == 128 else 3) * (q - 1)) / 1000), CONTEXTS, rows=8)
    assert len(cheap.trees) == 1 and cheap.trees[0]  # where a tree pays at every context, the batch drafts it
    online = AdaptiveTreePlan(stats, lambda c, correction=None: noisy_curve(spread=0.02).at(c, None, correction),
                              CONTEXTS, rows=8)
    assert len(online.trees) == 1


def test_a_batch_verifies_one_sam_policy_at_every_context_since_a_step_feeds_its_rows_largest():
    """As a tree plan (above), SAM's policy at 8 rows is one for every context: per context it verified a chain at
    short contexts and none at long ones, so a quarter of the rows' steps verified a chain while every step fed the
    largest block (0.94x at 8 rows). 20% of steps match spans that accept 4 tokens."""
    counts = {0: {(0, 0): 800}, 8: {(4, 0): 200}}
    per_token = lambda long: (lambda c: (lambda q: (60 + (2 if c == 128 else long) * (q - 1)) / 1000))  # noqa: E731
    none = lambda c: 0  # noqa: E731 -- no auxiliary tree
    alone = policy_plan(counts, per_token(60), CONTEXTS, none, max_chain=8)
    assert alone.option(100, 8).chain and not alone.option(1000, 8).chain
    rows8 = [best_policy(counts, per_token(60)(c), 0, max_chain=8, rows=8) for c in CONTEXTS]
    assert rows8[0].option(8).chain and not rows8[1].option(8).chain  # chosen per context, the two differ
    batch = policy_plan(counts, per_token(60), CONTEXTS, none, max_chain=8, rows=8)
    assert len(batch.choices) == 1 and batch.max_chain == 0  # chains at 512 would cost 60 ms a token in 83% of steps
    cheap = policy_plan(counts, per_token(3), CONTEXTS, none, max_chain=8, rows=8)
    assert len(cheap.choices) == 1 and cheap.option(1000, 8).chain  # where a chain pays at every context: verified
    speed = lambda p: policy_speed(counts, p.choices[0].options, per_token(3), CONTEXTS, none, rows=8)  # noqa: E731
    assert speed(cheap) > speed(batch)
    curve = noisy_curve(spread=0.02)
    online = AdaptivePolicyPlan(counts, lambda c, correction=None: curve.at(c, None, correction), CONTEXTS,
                                aux_nodes=none, max_chain=8, every=4, rows=8)
    for _ in range(64 * 8):  # the run's rows at both contexts match long spans that accept 8 tokens: re-planned
        for context in (200, 1000):
            online.observe_cost(context, 9, step_ms(9, 128) / 1000, 1 / 16)
            online.observe_scored(8, 8, 0, context)
    assert online.version and all(len(p.choices) == 1 for p in (online.initial, online.plan))


def test_a_plan_that_changes_mid_answer_keeps_the_output_greedy():
    """Token Recycling with a self-correcting plan whose statistics are wrong on purpose: the tree changes while
    answering, the output stays greedy decoding's token for token."""
    model = tiny_llama()
    prompt = [3, 4, 5, 6, 3, 4, 5, 6, 3, 4, 5]
    greedy = Engine(model, set()).generate(prompt, Drafter(VOCAB), 60).output_ids
    curve = noisy_curve(spread=0.02, step=steep_ms)
    pessimistic = NodeStats({(0,) * d: 0.1 * 0.9 ** d for d in range(1, 9)} | {(1,): 0.02}, steps=1000)
    online = AdaptiveTreePlan(pessimistic, lambda c, correction=None: curve.at(c, None, correction), CONTEXTS, every=4,
                              prior_steps=2)
    first = online.trees[0]
    drafter = TokenRecycling(VOCAB, tree=online)
    engine = Engine(model, set())
    for _ in range(3):  # hot start: the matrix learns, the plan sees its steps
        gen = engine.generate(prompt, drafter, 60)
        assert gen.output_ids == greedy
    stats = drafter.finish()
    assert online.version >= 1 and "plan_version" in stats
    assert online.trees[0] != first  # it left the tree the pessimistic statistics chose


def test_a_run_off_its_prediction_by_more_than_ten_percent_gets_a_warning_naming_the_part():
    import pandas as pd

    from evaluation import steps

    def row(measured: float, calibrated: float, mat: float, predicted_mat: float, predicted: float) -> dict:
        return {"label": "recycling-auto", "decode_tokens_per_s": measured, "calibrated_decode_tokens_per_s": calibrated,
                "mat": mat, "predicted_mat": predicted_mat, "predicted_decode_tokens_per_s": predicted,
                "plan_changes": 2.0}

    near = pd.DataFrame([row(18.5, 18.0, 1.6, 1.62, 20.0)])  # 7.5% off: no warning
    assert steps.warnings(near) == []
    slow = pd.DataFrame([row(17.0, 20.0, 1.6, 1.62, 20.0)])  # 15% off: the steps ran slower than calibrated
    [warning] = steps.warnings(slow)
    assert "-15%" in warning and "the calibration (replayed on the run's steps" in warning
    assert "the acceptance" not in warning
    assert "changed 2 times" in warning
    short = pd.DataFrame([row(16.0, 16.5, 1.3, 1.62, 20.0)])  # 20% off: fewer tokens per step than predicted
    [warning] = steps.warnings(short)
    assert "the acceptance (MAT 1.30 against 1.62" in warning and "the calibration" not in warning
    unplanned = pd.DataFrame([row(10.0, 20.0, 1.0, float("nan"), float("nan"))])  # no plan: nothing to compare
    assert steps.warnings(unplanned) == []
    # its correction turned drafting off on most steps: the low MAT is the plan's doing, named first
    stopped = pd.DataFrame([row(16.8, 17.1, 1.13, 1.60, 19.4) | {"draft_rate": 0.22, "predicted_draft_rate": 1.0}])
    [warning] = steps.warnings(stopped)
    assert "off: the plan as it corrected itself (it drafted on 22% of the steps, its first plan on 100%) and the " \
           "acceptance (MAT 1.13 against 1.60" in warning
    # the baseline ran 14% slower than calibrated too: the machine moved, and the speedup tells the plan apart
    baseline = {"label": "baseline", "reference": True, "decode_tokens_per_s": 15.7,
                "calibrated_decode_tokens_per_s": 17.9, "mat": 1.0, "predicted_mat": float("nan"),
                "predicted_decode_tokens_per_s": float("nan"), "plan_changes": float("nan")}
    drifted = pd.DataFrame([baseline, row(16.8, 18.9, 1.58, 1.60, 20.0) | {"reference": False}])
    [warning] = steps.warnings(drifted)
    assert "off: the machine (the baseline's steps, too, ran 14% slower than calibrated)" in warning
    assert "the calibration's shape" not in warning and "the acceptance" not in warning  # within the noise
    assert "decode speedup over the baseline (the machine's speed cancels): 1.07x against 1.12x predicted, -4%" \
        in warning
    kept = pd.DataFrame([row(16.0, 16.5, 1.3, 1.62, 20.0) | {"draft_rate": 0.98, "predicted_draft_rate": 1.0}])
    [warning] = steps.warnings(kept)
    assert "the plan as it corrected itself" not in warning and "the acceptance (MAT 1.30" in warning
