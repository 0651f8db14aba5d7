"""``method.tree=auto``: the draft tree chosen for this model, hardware, dtype and thread count.

Reads the device calibration (evaluation.calibrate) and the method's acceptance statistics
(evaluation.acceptance) from ``autotree.dir`` and hands the drafter a
:class:`~methods.tree_search.TreePlan`. A file made for another setup is refused with the keys that
differ, never used silently; a missing one gets the command that makes it (calibration takes a few
minutes on a CPU and statistics longer, too long to make on the spot before a benchmark).
"""

from __future__ import annotations

from pathlib import Path

import torch
from omegaconf import DictConfig

from evaluation import acceptance, calibrate
from evaluation.acceptance import drafter_class
from evaluation.data import resolve_path
from methods import tree_search
from methods.engine import Padding


class AutoTreeError(RuntimeError):
    """What ``tree=auto`` needs is missing or made for another setup; the message says what to do."""


def _command(module: str, cfg: DictConfig, extra: str = "") -> str:
    threads = f" threads={cfg.threads}" if cfg.threads else ""
    return (f"python -m evaluation.{module} model={cfg.model.name} device={cfg.device} dtype={cfg.dtype}{threads}"
            f"{extra} autotree.dir={cfg.autotree.dir}")


def _calibration(cfg: DictConfig, device: torch.device, dtype: torch.dtype) -> tuple[calibrate.Calibration, Path]:
    key = calibrate.machine_key(cfg.model.name, device, dtype)
    directory = resolve_path(cfg.autotree.dir)
    path = resolve_path(cfg.autotree.calibration) if cfg.autotree.calibration else calibrate.file_for(directory, key)
    if not path.is_file():
        others = sorted(directory.glob("calibration-*.json"))
        near = ""
        if others:
            diffs = {str(p): calibrate.key_diff(key, calibrate.Calibration.load(p).key) for p in others}
            best = min(diffs, key=lambda p: len(diffs[p]))
            near = f" ({best} exists but differs in {'; '.join(diffs[best])})"
        raise AutoTreeError(f"tree=auto needs a calibration of this machine and no {path} exists{near}; make it "
                            f"with: {_command('calibrate', cfg)}")
    calibration = calibrate.Calibration.load(path)
    diff = calibrate.key_diff(key, calibration.key)
    if diff:
        raise AutoTreeError(f"refusing calibration {path}: it was made for another setup, differing in "
                            f"{'; '.join(diff)}; calibrate this one with: {_command('calibrate', cfg)}")
    return calibration, path


def _statistics(cfg: DictConfig, method: DictConfig, dtype: str, questions: list[dict],
                policy: bool = False) -> tuple[acceptance.Acceptance | acceptance.PolicyStats, Path]:
    """The method's per-node statistics, or with ``policy`` its per-class ones, collected on other questions."""
    key = {"model": cfg.model.name, "dtype": dtype,
           "method": (acceptance.policy_key if policy else acceptance.method_key)(method)}
    evaluated = set(acceptance.question_hashes(questions))
    if cfg.autotree.acceptance and not policy:
        candidates = [resolve_path(cfg.autotree.acceptance)]
    else:
        candidates = acceptance.files_for(resolve_path(cfg.autotree.dir), cfg.model.name, dtype, method, policy=policy)
    make = _command("acceptance", cfg, f" method={method.name} data=<questions you do not evaluate>")
    what = f"method.{drafter_class(method).policy_param}=auto" if policy else "tree=auto"
    if not candidates or not candidates[0].is_file():
        raise AutoTreeError(f"{what} needs {'policy' if policy else 'acceptance'} statistics for {key} in "
                            f"{cfg.autotree.dir} and none exist; collect them with: {make}")
    usable, refused = [], []
    for path in candidates:
        stats = (acceptance.PolicyStats if policy else acceptance.Acceptance).load(path)
        diff = [f"{k} ({key[k]!r} vs {stats.key.get(k)!r})" for k in key if key[k] != stats.key.get(k)]
        overlap = len(evaluated & set(stats.question_hashes))
        if diff:
            refused.append(f"{path} differs in {'; '.join(diff)}")
        elif overlap and not cfg.autotree.allow_overlap:
            refused.append(f"{path} was collected on {overlap} of the questions evaluated here (its statistics "
                           "would flatter the chosen tree)")
        else:
            usable.append((stats.steps, str(path), stats, path))
    if not usable:
        raise AutoTreeError("refusing every acceptance statistics file: " + "; ".join(refused) +
                            f". Collect statistics on other questions with: {make} (or autotree.allow_overlap=true, "
                            "never for a published table)")
    _, _, stats, path = max(usable)  # the most steps
    return stats, path


def _drafting(cfg: DictConfig, device: torch.device, dtype: torch.dtype) -> tuple[calibrate.DraftingCalibration, Path]:
    key = calibrate.machine_key(cfg.model.name, device, dtype)
    settings = acceptance.method_key(cfg.method)
    path = calibrate.drafting_file_for(resolve_path(cfg.autotree.dir), key, cfg.method.name, settings)
    make = _command("calibrate", cfg, f" method={cfg.method.name}")
    if not path.is_file():
        raise AutoTreeError(f"tree=auto for {cfg.method.name} weighs its drafter's own time per draft, and no "
                            f"{path} exists; measure it (2 minutes for SmolLM2 on a 2-core CPU, after the "
                            f"calibration) with: {make}")
    drafting = calibrate.DraftingCalibration.load(path)
    diff = calibrate.key_diff(key, drafting.key)
    if drafting.method != settings:  # the file name holds a digest of the settings; a renamed file could lie
        diff.append(f"method settings ({settings} vs {drafting.method})")
    if diff:
        raise AutoTreeError(f"refusing drafting calibration {path}: made for another setup, differing in "
                            f"{'; '.join(diff)}; measure this one with: {make}")
    return drafting, path


def padding(cfg: DictConfig, device: torch.device, dtype: torch.dtype) -> tuple[Padding | None, dict]:
    """``autotree.pad``: the engine's block padding from this machine's calibration, and what the run header
    records of it. ``auto`` pads when the calibration exists, ``true`` requires it, ``false`` never pads."""
    mode = cfg.autotree.pad
    if mode not in ("auto", True, False):
        raise AutoTreeError(f"autotree.pad must be auto, true or false, got {mode!r}")
    if mode is False:
        return None, {"enabled": False}
    try:
        calibration, path = _calibration(cfg, device, dtype)
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
    calibration, calibration_path = _calibration(cfg, device, dtype)
    if tree_auto:
        stats, stats_path = _statistics(cfg, acceptance.statistics_method(cfg.method), dtype_name, questions)
        sources = {"calibration": str(calibration_path), "acceptance": str(stats_path), "padded": padded}
        draft = None
        if cls.drafting_cost:
            drafting, drafting_path = _drafting(cfg, device, dtype)
            draft, sources["drafting"] = drafting.cost, str(drafting_path)
        overrides[param] = tree_search.plan(stats.stats, calibration.padded_seconds if padded else calibration.seconds,
                                            calibration.contexts, sources=sources, draft=draft)
    if policy_auto:
        stats, stats_path = _statistics(cfg, cfg.method, dtype_name, questions, policy=True)
        sources = {"calibration": str(calibration_path), "policy_statistics": str(stats_path), "padded": padded}
        overrides[policy] = tree_search.policy_plan(
            stats.counts, calibration.padded_seconds if padded else calibration.seconds, calibration.contexts,
            cls.aux_nodes(cfg.method, overrides), stats.score, sources=sources)
    return overrides
