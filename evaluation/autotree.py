"""``method.tree=auto``: the draft tree chosen for this model, hardware, dtype and thread count.

Reads the device calibration and the method's acceptance statistics (found and checked by
:mod:`evaluation.store`) and hands the drafter a :class:`~methods.tree_search.TreePlan` (or a
:class:`~methods.tree_search.PolicyPlan`); also the engine's block padding from the calibration.

At ``batch_size=B`` > 1 both come from the calibration's step over B rows (a step costs T_B(q) and yields every
row's tokens, so the same planner chooses per row with the B-row curve, and a drafter's own per-draft time counts
B times: every row drafts), and need a calibration that holds B.
"""

from __future__ import annotations

from dataclasses import astuple
from typing import Callable, TypeVar

import torch
from omegaconf import DictConfig

from evaluation import store
from evaluation.store import AutoTreeError, drafter_class
from methods import tree_search
from methods.tree_search import DraftCost
from methods.online import AdaptivePolicyPlan, AdaptiveTreePlan
from methods.engine import Padding

T = TypeVar("T")


def padding(cfg: DictConfig, device: torch.device, dtype: torch.dtype) -> tuple[Padding | None, dict]:
    """``autotree.pad``: the engine's block padding from this machine's calibration, and what the run header
    records of it. ``auto`` pads when the calibration exists, ``true`` requires it, ``false`` never pads."""
    mode = cfg.autotree.pad
    if mode not in ("auto", True, False):
        raise AutoTreeError(f"autotree.pad must be auto, true or false, got {mode!r}")
    if mode is False:
        return None, {"enabled": False}
    batch = int(cfg.get("batch_size", 1))
    try:
        calibration, path = store.find_calibration(cfg, device, dtype)
        padding = _at_batch(cfg, calibration, path, batch, calibration.padding_at)
    except AutoTreeError as err:
        if mode is True:
            raise AutoTreeError(f"autotree.pad=true: {err}") from err
        why = "no calibration of this machine" + (f" at batch size {batch}" if batch > 1 else "")
        return None, {"enabled": False, "why": f"{why} (python -m evaluation.calibrate)"}
    facts = {"enabled": True, "calibration": str(path), **({"batch_size": batch} if batch > 1 else {})}
    return padding, {**facts, **padding.describe()}


def _at_batch(cfg: DictConfig, calibration: store.Calibration, path: object, batch: int,
              get: Callable[[int], T]) -> T:
    """``get(batch)`` of the calibration, or an AutoTreeError with the command that measures that batch size."""
    if batch not in calibration.batch_sizes:
        raise AutoTreeError(f"batch_size={batch}: calibration {path} holds batch sizes "
                            f"{list(calibration.batch_sizes)}; "
                            f"measure batch size {batch} with: {store.command('calibrate', cfg)} "
                            f"calibration.batch_sizes=[{batch}] (the sizes it holds are kept)")
    return get(batch)


def resolve(cfg: DictConfig, device: torch.device, dtype: torch.dtype, questions: list[dict],
            padded: bool = False) -> dict:
    """Constructor overrides for the drafter: ``{tree_param: plan}`` and ``{policy_param: policy}`` where the
    method asks for auto, else {}. With ``autotree.online`` (the default) the method's own plan corrects itself
    with the run's steps (:mod:`methods.online`), following the candidate tree scored in the shadow of every step
    where the drafter scores one (``shadow_param``); a tree that a drafter takes from another's statistics (SAM's
    fallback) stays as chosen, its policy being what corrects itself.
    ``padded``: the engine pads blocks as the calibration says, so a tree's step time is its padded size's."""
    cls = drafter_class(cfg.method)
    param, policy = cls.tree_param, cls.policy_param
    overrides: dict = {}
    dtype_name = str(dtype).removeprefix("torch.")
    tree_auto = param is not None and cfg.method.get(param) == "auto"
    policy_auto = policy is not None and cfg.method.get(policy) == "auto"
    if not (tree_auto or policy_auto):
        return overrides
    calibration, calibration_path = store.find_calibration(cfg, device, dtype)
    batch = int(cfg.get("batch_size", 1))
    _at_batch(cfg, calibration, calibration_path, batch, calibration.curve_at)
    cost_at = lambda context, correction=None: calibration.at(context, padded, correction, batch)  # noqa: E731
    if tree_auto:
        stats, stats_path = store.find_statistics(cfg, store.statistics_method(cfg.method), dtype_name, questions)
        sources = {"calibration": str(calibration_path), "acceptance": str(stats_path), "padded": padded,
                   **({"batch_size": batch} if batch > 1 else {})}
        draft = None
        if cls.drafting_cost:
            drafting, drafting_path = store.find_drafting(cfg, device, dtype)
            draft, sources["drafting"] = drafting.cost, str(drafting_path)
            if batch > 1:  # every row drafts: B drafts per step
                draft = lambda context: DraftCost(*(batch * v for v in astuple(drafting.cost(context))))  # noqa: E731
        if cfg.autotree.online and not cls.tree_owner:
            overrides[param] = AdaptiveTreePlan(stats.stats, cost_at, calibration.contexts, {**sources, "online": True},
                                                draft, rows=batch)
            if cls.shadow_param and cfg.method.get(cls.shadow_param) is None:  # exact acceptance, drafting or not
                overrides[cls.shadow_param] = cls.candidate_tree
        else:
            overrides[param] = tree_search.plan(stats.stats, cost_at, calibration.contexts, sources=sources,
                                                draft=draft, rows=batch)
    if policy_auto:
        stats, stats_path = store.find_statistics(cfg, cfg.method, dtype_name, questions, policy=True)
        sources = {"calibration": str(calibration_path), "policy_statistics": str(stats_path), "padded": padded,
                   **({"batch_size": batch} if batch > 1 else {})}
        aux_nodes = cls.aux_nodes(cfg.method, overrides)
        if cfg.autotree.online:
            overrides[policy] = AdaptivePolicyPlan(stats.counts, cost_at, calibration.contexts, aux_nodes, stats.score,
                                                   {**sources, "online": True}, rows=batch)
        else:
            overrides[policy] = tree_search.policy_plan(stats.counts, cost_at, calibration.contexts, aux_nodes,
                                                        stats.score, sources=sources, rows=batch)
    return overrides
