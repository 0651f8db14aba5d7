"""Per-step views of a benchmark: acceptance by depth and rank, and whether the cost model holds.

Result files record, per decode step, the tokens fed to the forward (``block_sizes``, padding included) and the sibling ranks of
the accepted draft nodes (``accept_paths``), and per turn the prompt length, so every step's context
length is known. From these:

* **acceptance by depth**: the share of drafting steps (at least one draft node) that accepted a node at
  depth d; **by rank**: the share whose accepted depth-1 node was the r-th alternative;
* **cost model**: the decode tokens/s the device calibration predicts for the steps the run actually
  made (does the calibration hold?), the MAT and decode tokens/s that a ``tree=auto`` plan predicted
  (do the acceptance statistics hold?), and the share of decode time spent outside the model forward
  (the engine's and the drafter's own cost).
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from pathlib import Path
from typing import Sequence

import pandas as pd

from evaluation.analysis import OVERALL, SETUP_KEYS, Comparison
from evaluation.categories import group_order
from evaluation.store import Calibration, calibration_for_run
from methods.costs import CostCurve, crossover, describe_crossover
from methods.tree_search import batched_seconds

MAX_DEPTH = 8
MAX_RANK = 8
SOURCE_ORDER = ("retrieval", "merged", "aux", "none")  # draft sources listed first, in this order


def _steps(comparison: Comparison) -> list[tuple[int, int, list[int]]]:
    frame = comparison.run.frame.loc[comparison.run.ok_ids]
    return [step for steps in frame["steps"] for step in steps]


def acceptance(comparisons: Sequence[Comparison]) -> pd.DataFrame:
    """One row per setup, platform and method label (pooled over its runs): drafting steps, depth and rank shares."""
    pooled: dict[tuple, list] = {}
    for c in comparisons:
        if not c.is_reference:
            pooled.setdefault((*c.setup, c.platform, c.run.label), []).extend(_steps(c))
    rows = []
    for key, steps in pooled.items():
        drafting = [path for _, size, path in steps if size > 1]
        if not drafting:
            continue
        row = {**dict(zip(SETUP_KEYS, key[:-2])), "platform": key[-2], "label": key[-1], "steps": len(steps),
               "draft_rate": len(drafting) / len(steps)}
        row |= {f"d{d}": sum(len(p) >= d for p in drafting) / len(drafting) for d in range(1, MAX_DEPTH + 1)}
        row |= {f"r{r}": sum(bool(p) and p[0] == r for p in drafting) / len(drafting) for r in range(MAX_RANK)}
        rows.append(row)
    return pd.DataFrame(rows)


def sources(comparisons: Sequence[Comparison]) -> pd.DataFrame:
    """Per setup, platform, method label and category group (pooled over runs): the share of decode steps
    by what the drafter verified (``retrieval``, ``aux``, ...), for drafters that report it."""
    pooled: dict[tuple, dict[str, dict[str, int]]] = {}
    for c in comparisons:
        frame = c.run.frame.loc[c.run.ok_ids]
        groups = pooled.setdefault((*c.setup, c.platform, c.run.label), {})
        for group, counts in zip(frame["group"], frame["sources"]):
            for g in (group, OVERALL):
                total = groups.setdefault(g, {})
                for source, n in counts.items():
                    total[source] = total.get(source, 0) + n
    rows = []
    for key, groups in pooled.items():
        for group in (g for g in group_order() if g in groups):
            steps = sum(groups[group].values())
            if steps:
                rows.append({**dict(zip(SETUP_KEYS, key[:-2])), "platform": key[-2], "label": key[-1],
                             "group": group, "steps": steps, **{source: n / steps for source, n in groups[group].items()}})
    table = pd.DataFrame(rows)
    if table.empty:
        return table
    fixed = [*SETUP_KEYS, "platform", "label", "group", "steps"]
    found = [c for c in table.columns if c not in fixed]
    order = [s for s in SOURCE_ORDER if s in found] + sorted(set(found) - set(SOURCE_ORDER))
    return table[fixed + order].fillna(0.0)  # a source a drafter never used: 0% of its steps


def _plan_prediction(plan: dict, steps: list, calibration: Calibration, batch: int = 1) -> tuple[float, float, float]:
    """Predicted MAT, decode tokens/s and share of drafting steps of a plan (a tree plan or a per-step policy; a
    policy's share is NaN: it drafts by class) at the steps' context lengths (``batch``: the batch size the plan
    was made for, whose calibrated step it weighed)."""
    buckets = plan["buckets"]
    bounds = [b["below"] for b in buckets[:-1]]
    padded = bool(plan.get("sources", {}).get("padded"))
    single = calibration.curve_at(batch).seconds
    tokens = seconds = drafted = 0.0
    for context, _, _ in steps:
        b = buckets[sum(context >= bound for bound in bounds)]
        tokens += b["expected_tokens"]
        if "by_class" in b:  # a per-step policy: its mean step, scaled from its context like a single token's
            seconds += b["step_ms"] / 1000 * single(1, context) / single(1, b["context"])
            drafted = math.nan
            continue
        rate = b.get("draft_rate", 1.0 if b["nodes"] else 0.0)
        drafted += rate
        drafting = b.get("draft_ms", 0.0) / 1000  # the drafter's own time, where the plan weighed it
        step = calibration.at(context, padded, batch=batch).seconds(b["nodes"] + 1)
        seconds += rate * (step + drafting) + (1 - rate) * single(1, context)
    return tokens / len(steps), tokens / seconds, drafted / len(steps)


def cost_model(comparisons: Sequence[Comparison], calibration_dir: Path) -> pd.DataFrame:
    """One row per run (Overall): measured decode tokens/s and MAT beside what the cost model predicts."""
    rows = []
    for c in comparisons:
        frame = c.run.frame.loc[c.run.ok_ids]
        steps = _steps(c)
        if not steps:
            continue
        decode_tokens, decode_time = frame["decode_tokens"].sum(), frame["decode_time"].sum()
        row = {**dict(zip(SETUP_KEYS, c.setup)), "platform": c.platform, "label": c.run.label, "run": c.run.index,
               "group": OVERALL, "reference": c.is_reference,
               "decode_tokens_per_s": decode_tokens / decode_time if decode_time > 0 else math.nan,
               "mat": frame["accept_sum"].sum() / frame["accept_steps"].sum(),
               "outside_forward": 1 - frame["forward_time"].sum(min_count=len(frame)) / decode_time,
               "plan_changes": frame["plan_changes"].sum(min_count=1),
               "draft_rate": sum(size > 1 for _, size, _ in steps) / len(steps),
               "calibrated_decode_tokens_per_s": math.nan, "predicted_mat": math.nan,
               "predicted_decode_tokens_per_s": math.nan, "predicted_draft_rate": math.nan}
        calibration = calibration_for_run(c.run.meta, calibration_dir)
        batch = c.run.batch_size
        if calibration is not None and batch in calibration.batch_sizes:  # a batched run: the step over its rows
            curve = calibration.curve_at(batch)
            row["calibrated_decode_tokens_per_s"] = decode_tokens / sum(
                curve.seconds(size, context) for context, size, _ in steps)
            drafter = (c.run.meta or {}).get("drafter") or {}
            plan = drafter.get("plan") or drafter.get("policy")
            if plan:
                (row["predicted_mat"], row["predicted_decode_tokens_per_s"],
                 row["predicted_draft_rate"]) = _plan_prediction(plan, steps, calibration, batch)
        rows.append(row)
    table = pd.DataFrame(rows)
    if table.empty:
        return table
    keys = [*SETUP_KEYS, "platform", "label", "group", "reference"]
    return table.groupby(keys, sort=False).agg(n_runs=("run", "nunique"), **{
        col: (col, "mean") for col in ("decode_tokens_per_s", "calibrated_decode_tokens_per_s", "mat",
                                       "predicted_mat", "predicted_decode_tokens_per_s", "outside_forward",
                                       "plan_changes", "draft_rate", "predicted_draft_rate")
    }).reset_index()


def predicted_speedup(steps: Sequence[tuple[int, int, list[int]]], curve: CostCurve, rows: int = 1) -> float:
    """The speedup over the baseline that a step cost ``curve`` predicts for a run's steps (context, tokens fed,
    accepted ranks): its tokens per calibrated second over one token per calibrated single-token step at the same
    contexts. The forward's cost only: the drafter's and the engine's own time per step are left out. ``rows``
    (the curve's batch size): a step feeds the largest of its rows' blocks, the rows drawn from these steps
    (:func:`methods.tree_search.batched_seconds`, at their median context)."""
    tokens = sum(1 + len(ranks) for _, _, ranks in steps)
    seconds = sum(curve.seconds(fed, context) for context, fed, _ in steps)
    single = sum(curve.seconds(1, context) for context, _, _ in steps)
    if rows > 1:
        context = statistics.median(context for context, _, _ in steps)
        shares = Counter(fed for _, fed, _ in steps)
        at = lambda q: curve.seconds(q, context)  # noqa: E731
        seconds *= batched_seconds(shares, at, rows) / batched_seconds(shares, at, 1)
    return tokens / seconds * single / len(steps)


def batch_prediction(comparisons: Sequence[Comparison], calibration_dir: Path) -> pd.DataFrame:
    """Per method (its label without the batch size): the speedup over the baseline at every batch size the run's
    calibration holds, predicted from the steps of its run at the smallest batch size (the trees it verified and
    what they accepted: a tree=auto plan chooses per batch size, so this is the tree it chose there) and the
    calibrated step over B rows (:func:`predicted_speedup`), and the batch size above which it is predicted to lose
    (methods.costs.crossover). Empty where no calibration holds more than one batch size."""
    chosen: dict[tuple, Comparison] = {}
    for c in comparisons:
        key = (*c.setup, c.platform, c.run.series)
        if not c.is_reference and (key not in chosen or c.run.batch_size < chosen[key].run.batch_size):
            chosen[key] = c
    rows = []
    for key, c in chosen.items():
        found = _steps(c)
        calibration = calibration_for_run(c.run.meta, calibration_dir)
        if not found or calibration is None or len(calibration.batch_sizes) < 2:
            continue
        speedups = {b: predicted_speedup(found, calibration.curve_at(b), b) for b in calibration.batch_sizes}
        pays, loses = crossover(speedups)
        rows.append({**dict(zip([*SETUP_KEYS, "platform", "series"], key)), "from_batch_size": c.run.batch_size,
                     "predicted": speedups, "pays_up_to": pays, "loses_from": loses,
                     "text": describe_crossover(speedups)})
    return pd.DataFrame(rows)


OFF = 0.10  # a run this far from its plan's prediction gets a warning


def warnings(cost: pd.DataFrame) -> list[str]:
    """A warning per ``=auto`` method whose measured decode tokens/s is more than ``OFF`` from its plan's
    prediction, naming which part was off: the calibration (its times replayed on the steps the run made, against
    the run's own time; where the baseline's steps were off as well, split into the machine, whose speed moved
    since it was calibrated, and the calibration's shape beyond that), the acceptance (the MAT the plan predicted,
    against the run's), or the plan itself as it corrected itself while running (the share of steps it drafted on,
    against its first plan's): a run that mostly stopped drafting has a low MAT because of its plan, not because its
    drafts were accepted less."""
    found = []
    for _, row in cost.iterrows() if not cost.empty else ():
        predicted, measured = row["predicted_decode_tokens_per_s"], row["decode_tokens_per_s"]
        if not (predicted > 0 and measured > 0) or abs(measured / predicted - 1) <= OFF:
            continue
        calibration = row["calibrated_decode_tokens_per_s"] / measured - 1  # > 0: the steps ran slower than calibrated
        acceptance = row["mat"] / row["predicted_mat"] - 1  # < 0: fewer tokens per step than predicted
        baseline = _baseline(cost, row)
        machine = math.nan if baseline is None else \
            baseline["calibrated_decode_tokens_per_s"] / baseline["decode_tokens_per_s"] - 1
        parts = {f"the acceptance (MAT {row['mat']:.2f} against {row['predicted_mat']:.2f} predicted, "
                 f"{100 * acceptance:+.0f}%)": abs(acceptance)}
        if abs(machine) > OFF / 2:  # the baseline's steps were off too: the machine's speed moved since calibrating
            shape = (1 + calibration) / (1 + machine) - 1
            parts[f"the machine (the baseline's steps, too, ran {100 * abs(machine):.0f}% "
                  f"{'slower' if machine > 0 else 'faster'} than calibrated)"] = abs(machine)
            parts[f"the calibration's shape (this method's steps {100 * abs(shape):.0f}% "
                  f"{'slower' if shape > 0 else 'faster'} than calibrated beyond the baseline's)"] = abs(shape)
        else:
            parts[f"the calibration (replayed on the run's steps, it predicted their time {100 * calibration:+.0f}% "
                  f"off: {'faster' if calibration > 0 else 'slower'} than they ran)"] = abs(calibration)
        drafted, planned = row.get("draft_rate", math.nan), row.get("predicted_draft_rate", math.nan)
        if planned > 0 and drafted >= 0:
            parts[f"the plan as it corrected itself (it drafted on {100 * drafted:.0f}% of the steps, its first plan "
                  f"on {100 * planned:.0f}%)"] = abs(drafted / planned - 1)
        named = [text for text, size in sorted(parts.items(), key=lambda kv: -kv[1]) if size > OFF / 2] or list(parts)
        changes = "" if math.isnan(row["plan_changes"]) else f"; its plan changed {row['plan_changes']:.0f} times as it ran"
        relative = ""
        if baseline is not None and baseline["calibrated_decode_tokens_per_s"] > 0:
            runs = measured / baseline["decode_tokens_per_s"]
            plans = predicted / baseline["calibrated_decode_tokens_per_s"]
            relative = (f"; as a decode speedup over the baseline (the machine's speed cancels): {runs:.2f}x against "
                        f"{plans:.2f}x predicted, {100 * (runs / plans - 1):+.0f}%")
        found.append(f"warning: {row['label']} ran at {measured:.1f} decode tok/s, {100 * (measured / predicted - 1):+.0f}% "
                     f"from the {predicted:.1f} its plan predicted; off: {' and '.join(named)}{changes}{relative}")
    return found


def _baseline(cost: pd.DataFrame, row: pd.Series) -> pd.Series | None:
    """The baseline's row of ``row``'s setup, where the table has one with a calibrated figure."""
    if "reference" not in cost:
        return None
    same = cost[cost["reference"].astype(bool)]
    for key in (*SETUP_KEYS, "platform"):
        if key in cost:
            same = same[same[key] == row[key]]
    same = same[same["calibrated_decode_tokens_per_s"] > 0]
    return None if same.empty else same.iloc[0]
