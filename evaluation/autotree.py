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
    """Constructor overrides for the drafter: ``{tree_param: TreePlan}`` and ``{policy_param: PolicyPlan}`` where
    the method asks for auto, else {}.
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
    if tree_auto:
        stats, stats_path = store.find_statistics(cfg, store.statistics_method(cfg.method), dtype_name, questions)
        sources = {"calibration": str(calibration_path), "acceptance": str(stats_path), "padded": padded}
        draft = None
        if cls.drafting_cost:
            drafting, drafting_path = store.find_drafting(cfg, device, dtype)
            draft, sources["drafting"] = drafting.cost, str(drafting_path)
        overrides[param] = tree_search.plan(stats.stats, calibration.padded_seconds if padded else calibration.seconds,
                                            calibration.contexts, sources=sources, draft=draft)
    if policy_auto:
        stats, stats_path = store.find_statistics(cfg, cfg.method, dtype_name, questions, policy=True)
        sources = {"calibration": str(calibration_path), "policy_statistics": str(stats_path), "padded": padded}
        overrides[policy] = tree_search.policy_plan(
            stats.counts, calibration.padded_seconds if padded else calibration.seconds, calibration.contexts,
            cls.aux_nodes(cfg.method, overrides), stats.score, sources=sources)
    return overrides
