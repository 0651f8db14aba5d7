"""``method.tree=auto``: the draft tree chosen for this model, hardware, dtype and thread count.

Reads the device calibration and the method's acceptance statistics (found and checked by
:mod:`evaluation.store`) and hands the drafter a :class:`~methods.tree_search.TreePlan` (or a
:class:`~methods.tree_search.PolicyPlan`); also the engine's block padding from the calibration.
"""

from __future__ import annotations

import torch
from omegaconf import DictConfig

from evaluation import store
from evaluation.store import AutoTreeError, drafter_class
from methods import tree_search
from methods.online import AdaptivePolicyPlan, AdaptiveTreePlan
from methods.engine import Padding


def padding(cfg: DictConfig, device: torch.device, dtype: torch.dtype) -> tuple[Padding | None, dict]:
    """``autotree.pad``: the engine's block padding from this machine's calibration, and what the run header
    records of it. ``auto`` pads when the calibration exists, ``true`` requires it, ``false`` never pads."""
    mode = cfg.autotree.pad
    if mode not in ("auto", True, False):
        raise AutoTreeError(f"autotree.pad must be auto, true or false, got {mode!r}")
    if mode is False:
        return None, {"enabled": False}
    try:
        calibration, path = store.find_calibration(cfg, device, dtype)
    except AutoTreeError as err:
        if mode is True:
            raise AutoTreeError(f"autotree.pad=true: {err}") from err
        return None, {"enabled": False, "why": "no calibration of this machine (python -m evaluation.calibrate)"}
    return calibration.padding, {"enabled": True, "calibration": str(path), **calibration.padding.describe()}


def resolve(cfg: DictConfig, device: torch.device, dtype: torch.dtype, questions: list[dict],
            padded: bool = False) -> dict:
    """Constructor overrides for the drafter: ``{tree_param: plan}`` and ``{policy_param: policy}`` where the
    method asks for auto, else {}. With ``autotree.online`` (the default) the method's own plan corrects itself
    with the run's steps (:mod:`methods.online`); a tree that a drafter takes from another's statistics (SAM's
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
    cost_at = lambda context, scale=None: calibration.at(context, padded, scale)  # noqa: E731
    if tree_auto:
        stats, stats_path = store.find_statistics(cfg, store.statistics_method(cfg.method), dtype_name, questions)
        sources = {"calibration": str(calibration_path), "acceptance": str(stats_path), "padded": padded}
        draft = None
        if cls.drafting_cost:
            drafting, drafting_path = store.find_drafting(cfg, device, dtype)
            draft, sources["drafting"] = drafting.cost, str(drafting_path)
        if cfg.autotree.online and not cls.tree_owner:
            overrides[param] = AdaptiveTreePlan(stats.stats, cost_at, calibration.contexts, {**sources, "online": True},
                                                draft)
        else:
            overrides[param] = tree_search.plan(stats.stats, cost_at, calibration.contexts, sources=sources,
                                                draft=draft)
    if policy_auto:
        stats, stats_path = store.find_statistics(cfg, cfg.method, dtype_name, questions, policy=True)
        sources = {"calibration": str(calibration_path), "policy_statistics": str(stats_path), "padded": padded}
        aux_nodes = cls.aux_nodes(cfg.method, overrides)
        if cfg.autotree.online:
            overrides[policy] = AdaptivePolicyPlan(stats.counts, cost_at, calibration.contexts, aux_nodes, stats.score,
                                                   {**sources, "online": True})
        else:
            overrides[policy] = tree_search.policy_plan(stats.counts, cost_at, calibration.contexts, aux_nodes,
                                                        stats.score, sources=sources)
    return overrides
