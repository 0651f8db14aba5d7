"""The files ``=auto`` plans are made from: what they are called, how they are keyed, loaded, refused and written.

Three kinds live in ``autotree.dir`` (default ``results/calibration/``):

* a **calibration** (``calibration-*.json``, :class:`Calibration`): this machine's time of a verification step over
  ``q`` tokens at several context lengths, keyed by what speed depends on (:func:`machine_key`), measured by
  ``python -m evaluation.calibrate``; and of a batched step over B rows of ``q`` tokens for the batch sizes it holds
  (``key.batch_sizes``; 1 alone by default);
* a **drafting calibration** (``drafting-*.json``, :class:`DraftingCalibration`): a drafter's own time per draft
  (EAGLE's head), keyed by the machine and the method's settings;
* **acceptance statistics** (``acceptance-*.json``, :class:`Acceptance`; ``policy-*.json``, :class:`PolicyStats`):
  how often each node of a wide candidate tree (or each option of a per-step policy) is accepted, keyed by model,
  dtype and the method's settings, and where it samples by the sampling settings (:func:`sampling_key`: acceptance
  depends on the temperature), collected by ``python -m evaluation.acceptance`` on questions that are not
  evaluated.

A file made for another setup is refused with the keys that differ, never used silently; a missing one gets the
command that makes it. Measuring and collecting live in :mod:`evaluation.calibrate` and
:mod:`evaluation.acceptance`; choosing a plan from these files in :mod:`evaluation.autotree`.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Iterable

import numpy as np
import torch
from hydra.utils import get_class
from omegaconf import DictConfig, OmegaConf

from evaluation import data as datasets
from evaluation import models
from methods.costs import ContextCost, Correction, CostCurve, bounds, interp
from methods.engine import Padding
from methods.sampling import Sampling
from methods.paths import PROJECT_ROOT, resolve_path
from methods.tree_search import DraftCost, NodeStats


class StoreError(RuntimeError):
    """A calibration or statistics file is missing, unreadable or made for another setup; the message says what
    to do."""


KEY_FIELDS = ("device_name", "model", "dtype", "threads", "torch", "masked_gqa", "format")
# What a step is timed as: 2 = the engine's step as it runs (its KV cache, an accepted path moved into place, no
# forward timer), every repeat kept. A calibration of another format is measured anew.
CALIBRATION_FORMAT = 2


class AutoTreeError(StoreError):
    """What ``tree=auto`` needs is missing or made for another setup; the message says what to do."""


class CalibrationError(StoreError):
    """A calibration file is missing, unreadable or made for another setup; the message says what to do."""


def machine_key(model: str, device: torch.device, dtype: torch.dtype) -> dict:
    """What a step's time depends on besides the shapes: a calibration is valid only for the same key."""
    return {"device_name": models.device_name(device), "model": model,
            "dtype": str(dtype).removeprefix("torch."), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "masked_gqa": models.masked_gqa(device), "format": CALIBRATION_FORMAT}


def key_diff(mine: dict, theirs: dict) -> list[str]:
    """The key fields that differ, as ``field (this vs that)``."""
    return [f"{k} ({mine.get(k)!r} vs {theirs.get(k)!r})" for k in KEY_FIELDS if mine.get(k) != theirs.get(k)]


def calibration_path(directory: Path, key: dict) -> Path:
    slug = "-".join(str(key[k]) for k in ("model", "dtype", "device_name")) + f"-t{key['threads']}-torch{key['torch']}"
    return directory / f"calibration-{re.sub(r'[^A-Za-z0-9.]+', '_', slug)}.json"


@dataclass(frozen=True)
class Calibration:
    """This machine's step times: every repeat (ms) per context length and block size q, and what the machine's
    own drift during the measurement was. Its :attr:`curve` is the fitted cost with bootstrap replicates.

    ``batches`` holds the same for a batched step over B rows of q tokens each (B > 1, the same contexts and sizes):
    ``{B: {"samples_ms": ..., "drift": ...}}``; :meth:`curve_at`, :meth:`padding_at` and :meth:`at` serve a batch
    size."""

    key: dict
    contexts: tuple[int, ...]
    sizes: tuple[int, ...]
    samples_ms: tuple[tuple[tuple[float, ...], ...], ...]  # [context][size][repeat]
    drift: dict  # a reference point timed at the start, the middle and the end (evaluation.calibrate)
    provenance: dict
    batches: dict = field(default_factory=dict)  # B > 1 -> {"samples_ms": [context][size][repeat], "drift": {...}}

    @cached_property
    def curve(self) -> CostCurve:
        return CostCurve.from_samples(self.contexts, self.sizes, self.samples_ms)

    @property
    def batch_sizes(self) -> tuple[int, ...]:
        return (1, *sorted(self.batches))

    def curve_at(self, batch: int) -> CostCurve:
        """The step cost over ``batch`` rows (1: :attr:`curve`); CalibrationError where it was not measured."""
        if batch == 1:
            return self.curve
        if batch not in self.batches:
            raise CalibrationError(f"the calibration holds batch sizes {list(self.batch_sizes)}, not {batch}; "
                                   f"measure it with python -m evaluation.calibrate calibration.batch_sizes=[{batch}] "
                                   "(the sizes it holds are kept)")
        cached = self.__dict__.setdefault("_curves", {})
        if batch not in cached:
            cached[batch] = CostCurve.from_samples(self.contexts, self.sizes, self.batches[batch]["samples_ms"])
        return cached[batch]

    def padding_at(self, batch: int) -> Padding:
        """:attr:`padding` for a batched step over ``batch`` rows."""
        if batch == 1:
            return self.padding
        cached = self.__dict__.setdefault("_paddings", {})
        if batch not in cached:
            curve = self.curve_at(batch)
            cached[batch] = Padding(bounds=bounds(self.contexts), sizes=tuple(curve.pad_table(c) for c in self.contexts))
        return cached[batch]

    def seconds(self, q: int, context: int) -> float:
        """Predicted time of a step over ``q`` tokens at a context length (the fitted curve)."""
        return self.curve.seconds(q, context)

    @cached_property
    def padding(self) -> Padding:
        """How the engine should feed a block on this machine: per calibrated context (buckets end halfway,
        geometrically, to the next, as a tree plan's do), :meth:`~methods.costs.CostCurve.pad_table`."""
        return Padding(bounds=bounds(self.contexts), sizes=tuple(self.curve.pad_table(c) for c in self.contexts))

    def padded_seconds(self, q: int, context: int) -> float:
        """Predicted time of a step over ``q`` tokens fed as :attr:`padding` says."""
        return self.seconds(self.padding.size(q, context), context)

    def at(self, context: int, padded: bool, correction: Correction | None = None,
           batch: int = 1) -> ContextCost:
        """The step cost a plan bucket at ``context`` is chosen with (blocks padded as the engine will pad them),
        corrected per fed size by a run's own steps (``correction``); ``batch``: of a step over that many rows,
        which yields that many rows' tokens, so that the same planner chooses per row with it."""
        if batch == 1:
            return self.curve.at(context, self.padding.table(context) if padded else None, correction)
        return self.curve_at(batch).at(context, self.padding_at(batch).table(context) if padded else None, correction)

    def summary(self) -> str:
        """The calibration's precision and drift in one line."""
        precision = self.curve.describe()
        repeats = [len(point) for row in self.samples_ms for point in row]
        line = (f"{len(self.contexts)} contexts x {len(self.sizes)} sizes, {min(repeats)}-{max(repeats)} repeats a "
                f"point; 90% intervals: median +/-{100 * precision['median_half_interval']:.1f}%, widest "
                f"+/-{100 * precision['widest_half_interval']:.1f}% (context {precision['widest_at']['context']})")
        if self.drift:
            line += f"; {self.drift['verdict']}"
        if self.batches:
            line += f"; batch sizes {list(self.batch_sizes)}"
        return line

    def to_json(self) -> dict:
        body = {"key": {**self.key, "batch_sizes": list(self.batch_sizes)}, "contexts": list(self.contexts),
                "sizes": list(self.sizes), "samples_ms": [[list(p) for p in row] for row in self.samples_ms],
                "drift": self.drift, "precision": self.curve.describe(), "provenance": self.provenance}
        if self.batches:
            body["batches"] = {str(b): {"samples_ms": [[list(p) for p in row] for row in v["samples_ms"]],
                                        "drift": v.get("drift", {}), "precision": self.curve_at(b).describe()}
                               for b, v in sorted(self.batches.items())}
        return body

    @classmethod
    def load(cls, path: Path) -> Calibration:
        try:
            raw = json.loads(path.read_text())
            batches = {int(b): {"samples_ms": tuple(tuple(tuple(p) for p in row) for row in v["samples_ms"]),
                                "drift": v.get("drift", {})} for b, v in raw.get("batches", {}).items()}
            return cls(key=raw["key"], contexts=tuple(raw["contexts"]), sizes=tuple(raw["sizes"]),
                       samples_ms=tuple(tuple(tuple(p) for p in row) for row in raw["samples_ms"]),
                       drift=raw.get("drift", {}), provenance=raw.get("provenance", {}), batches=batches)
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise CalibrationError(f"{path}: not a readable calibration file of this draftbench ({err}); delete it "
                                   "and rerun python -m evaluation.calibrate") from err


@dataclass(frozen=True)
class DraftingCalibration:
    """A drafter's own time per draft on this machine: measured trees and the fitted cost per context."""

    key: dict  # the machine's (as a Calibration's)
    method: dict  # the method's settings but its tree (evaluation.method_key)
    contexts: tuple[int, ...]
    trees: tuple[tuple[int, int], ...]  # (depth, inner nodes) of every tree measured
    draft_ms: tuple[tuple[float, ...], ...]  # [context][tree], median per draft (propose + observe)
    provenance: dict

    @cached_property
    def fitted(self) -> tuple[DraftCost, ...]:
        """Per context, the non-negative least-squares :class:`DraftCost` (seconds): a cost never negative."""
        return tuple(DraftCost(*_nonnegative_fit(np.array([[1.0, d - 1, inner] for d, inner in self.trees]),
                                                 np.asarray(row) / 1000)) for row in self.draft_ms)

    def cost(self, context: int) -> DraftCost:
        """The fitted cost at a context length: each term linear between (and past) the measured contexts."""
        terms = zip(*((f.base, f.per_level, f.per_node) for f in self.fitted))
        return DraftCost(*(max(float(interp(context, self.contexts, np.asarray(t))), 0.0) for t in terms))

    def to_json(self) -> dict:
        return {"key": self.key, "method": self.method, "contexts": list(self.contexts),
                "trees": [list(t) for t in self.trees], "draft_ms": [list(r) for r in self.draft_ms],
                "fitted_ms": [{"base": 1000 * f.base, "per_level": 1000 * f.per_level, "per_node": 1000 * f.per_node}
                              for f in self.fitted], "provenance": self.provenance}

    @classmethod
    def load(cls, path: Path) -> DraftingCalibration:
        try:
            raw = json.loads(path.read_text())
            return cls(key=raw["key"], method=raw["method"], contexts=tuple(raw["contexts"]),
                       trees=tuple(map(tuple, raw["trees"])), draft_ms=tuple(map(tuple, raw["draft_ms"])),
                       provenance=raw.get("provenance", {}))
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise CalibrationError(f"{path}: not a readable drafting calibration ({err}); delete it and rerun "
                                   "python -m evaluation.calibrate method=...") from err


def _nonnegative_fit(x: np.ndarray, y: np.ndarray) -> list[float]:
    """Least squares with every coefficient >= 0, exact for a few columns: the best fit over the subsets of
    columns whose own unconstrained fit is non-negative (the zero fit always qualifies)."""
    best, best_err = np.zeros(x.shape[1]), float(y @ y)
    for mask in range(1, 2 ** x.shape[1]):
        cols = [j for j in range(x.shape[1]) if mask >> j & 1]
        coef, *_ = np.linalg.lstsq(x[:, cols], y, rcond=None)
        err = float(np.sum((x[:, cols] @ coef - y) ** 2))
        if (coef >= 0).all() and err < best_err:
            best, best_err = np.zeros(x.shape[1]), err
            best[cols] = coef
    return [float(c) for c in best]


def drafting_path(directory: Path, key: dict, method_name: str, method: dict) -> Path:
    digest = hashlib.sha1(json.dumps(method, sort_keys=True).encode()).hexdigest()[:8]
    path = calibration_path(directory, key)
    return path.with_name(path.name.replace("calibration-", f"drafting-{method_name}-{digest}-"))



def stale(path: Path, kind: type[Calibration] | type[DraftingCalibration], key: dict) -> bool:
    """Whether ``path`` must be measured (anew): missing, or made under a key its name does not show."""
    if not path.is_file():
        return True
    diff = key_diff(key, kind.load(path).key)
    if diff:
        print(f"calibrate: {path} was made for another setup ({'; '.join(diff)}): measuring anew", file=sys.stderr)
    return bool(diff)


def calibration_for_run(meta: dict | None, directory: Path) -> Calibration | None:
    """The calibration made on the run's own machine, model, dtype, threads and torch, if there is one."""
    if not meta:
        return None
    key = {"device_name": meta.get("device_name"), "model": meta.get("model"), "dtype": meta.get("dtype"),
           "threads": meta.get("torch_threads"), "torch": (meta.get("versions") or {}).get("torch")}
    if None in key.values():
        return None
    path = calibration_path(directory, key)
    try:
        return Calibration.load(path) if path.is_file() else None
    except CalibrationError:
        return None


def write_json(path: Path, body: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(body, indent=1))
    tmp.replace(path)



class AcceptanceError(StoreError):
    """Statistics that are missing, unreadable or made for another setup; the message says what to do."""


def drafter_class(method: DictConfig) -> type:
    return get_class(method["_target_"])


def tunable(method: DictConfig) -> tuple[type, str]:
    """The drafter class of a method config and the constructor argument that sets its tree."""
    cls = drafter_class(method)
    if not cls.tree_param:
        raise AcceptanceError(f"method {method.name!r} has no tree to choose (its drafter {cls.__name__} sets no "
                              "tree_param); auto trees exist for recycling and eagle (method.tree) and pld "
                              "(method.num_pred_tokens)")
    if cls.tree_owner:
        raise AcceptanceError(f"method {method.name!r} drafts its method.{cls.tree_param} with {cls.tree_owner}: "
                              f"its statistics are {cls.tree_owner}'s (acceptance.statistics_method)")
    return cls, cls.tree_param


def first_verified(method: DictConfig, key: str, statistics_tree: object = None) -> object:
    """What the first pass of a collection verifies for ``method.<key>``: its value, or where that is ``auto``
    (no plan exists yet) the drafter's ``statistics_tree`` where it names one, else the method's own default
    (``conf/method/<name>.yaml``)."""
    value = method[key]
    if value != "auto":
        return value
    return statistics_tree or OmegaConf.load(PROJECT_ROOT / "conf" / "method" / f"{method.name}.yaml")[key]


def statistics_method(method: DictConfig) -> DictConfig:
    """The method config whose statistics choose ``method``'s tree: its own, or its tree owner's
    (``conf/method/<owner>.yaml``) with the settings the two share (e.g. ``k``) taken from ``method``."""
    owner = drafter_class(method).tree_owner
    if not owner:
        return method
    config = OmegaConf.load(PROJECT_ROOT / "conf" / "method" / f"{owner}.yaml")
    own = drafter_class(config).tree_param
    for key in config:
        if key not in ("_target_", "name", "label", own) and key in method:
            config[key] = method[key]
    return config


def method_key(method: DictConfig, sampled: bool = False) -> dict:
    """The method's settings that acceptance depends on: all but its tree, shadow tree, name and label, and for
    greedy decoding (not ``sampled``) the settings that change drafts only under sampling (``sampling_params``)."""
    cls, param = tunable(method)
    plain = OmegaConf.to_container(method, resolve=False)
    drop = (param, cls.shadow_param, "name", "label", *(() if sampled else cls.sampling_params))
    return {k: v for k, v in sorted(plain.items()) if k not in drop}


def policy_key(method: DictConfig, sampled: bool = False) -> dict:
    """The settings a drafter's per-class statistics depend on: all but the policy, the scoring and what a
    policy replaces (SAM's threshold and chain length), and as :func:`method_key` the sampling-only ones."""
    cls = drafter_class(method)
    if not cls.policy_param:
        raise AcceptanceError(f"method {method.name!r} has no per-step policy to choose (its drafter {cls.__name__} "
                              "sets no policy_param); method.mode=auto exists for sam")
    drop = (cls.policy_param, cls.score_param, *cls.policy_replaces, "name", "label",
            *(() if sampled else cls.sampling_params))
    return {k: v for k, v in sorted(OmegaConf.to_container(method, resolve=False).items()) if k not in drop}


def sampling_key(cfg: DictConfig) -> dict:
    """The sampling settings acceptance depends on (temperature, top_k, top_p: not the seed, which draws other
    samples of the same distribution); {} for greedy decoding, so that greedy statistics keep their names and keys."""
    rule = Sampling.of(cfg.get("sampling"))
    return {} if rule.greedy else {"temperature": rule.temperature, "top_k": rule.top_k, "top_p": rule.top_p}


def sampling_overrides(cfg: DictConfig) -> str:
    """The command-line overrides of a sampling setup ("" for greedy decoding), for the commands this module prints."""
    return "".join(f" sampling.{k}={v}" for k, v in sampling_key(cfg).items())


def question_hashes(questions: Iterable[dict]) -> list[str]:
    """Questions by content, so overlap is found across files whatever their ids."""
    return sorted({hashlib.sha1(json.dumps(q["turns"]).encode()).hexdigest()[:16] for q in questions})


def _name_part(text: str) -> str:
    """``text`` as it stands in a statistics file's name."""
    return re.sub(r"[^A-Za-z0-9.=-]+", "_", text)


def statistics_paths(directory: Path, model: str, dtype: str, method: DictConfig, data: str = "*",
                     policy: bool = False, sampled: dict | None = None) -> list[Path]:
    """The statistics files of this model, dtype and method (one per question set; ``data="*"``: all of them, at
    every temperature, so that a refusal can name what differs); ``policy``: its per-class statistics
    (``policy-*.json``, for ``mode=auto``), else its per-node ones; ``sampled``: the :func:`sampling_key`, in the
    name of a sampled one (``-T0.7-k0-p0.9``)."""
    digest = hashlib.sha1(json.dumps((policy_key if policy else method_key)(method, bool(sampled)),
                                     sort_keys=True).encode())
    kind = "policy" if policy else "acceptance"
    stem = _name_part(f"{kind}-{model}-{dtype}-{method.name}-{digest.hexdigest()[:8]}")
    if data == "*":
        return sorted(directory.glob(f"{stem}-*.json"))
    tag = "-T{temperature:g}-k{top_k}-p{top_p:g}".format(**sampled) if sampled else ""
    return [directory / f"{stem}{tag}-{_name_part(data)}.json"]



@dataclass(frozen=True)
class Acceptance:
    """A statistics file: the key it was made under, per-node acceptance, and where it came from."""

    key: dict
    stats: NodeStats
    steps: int
    question_hashes: tuple[str, ...]
    provenance: dict

    @classmethod
    def load(cls, path: Path) -> Acceptance:
        try:
            raw = json.loads(path.read_text())
            probs = {tuple(node["path"]): float(node["p"]) for node in raw["nodes"]}
            return cls(key=raw["key"], stats=NodeStats(probs, float(raw["draft_rate"]), int(raw.get("drafting_steps", 0))),
                       steps=int(raw["steps"]),
                       question_hashes=tuple(raw["question_hashes"]), provenance=raw.get("provenance", {}))
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise AcceptanceError(f"{path}: not a readable acceptance statistics file ({err}); delete it and rerun "
                                  "python -m evaluation.acceptance") from err


@dataclass(frozen=True)
class PolicyStats:
    """A per-class statistics file: steps by match-length class and how deep the scored chain and the
    auxiliary's draft would have been accepted (what ``mode=auto`` chooses from)."""

    key: dict
    counts: dict[int, dict[tuple[int, int], int]]
    score: int  # the chain length scored
    steps: int
    question_hashes: tuple[str, ...]
    provenance: dict

    @classmethod
    def load(cls, path: Path) -> PolicyStats:
        try:
            raw = json.loads(path.read_text())
            counts = {int(m): {tuple(map(int, depths.split(":"))): int(n) for depths, n in table.items()}
                      for m, table in raw["classes"].items()}
            return cls(key=raw["key"], counts=counts, score=int(raw["score"]), steps=int(raw["steps"]),
                       question_hashes=tuple(raw["question_hashes"]), provenance=raw.get("provenance", {}))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            raise AcceptanceError(f"{path}: not a readable policy statistics file ({err}); delete it and rerun "
                                  "python -m evaluation.acceptance") from err


def reusable_statistics(cfg: DictConfig, policy: bool, expected: dict) -> Path | None:
    """The statistics file this collection would write, if one exists for the same model, dtype, method settings,
    questions and token budget and holds the ``expected`` fields (what was scored); ``autotree.redo=true``: never.
    Statistics do not depend on the hardware or the code version, so a rerun (``make bench`` after a pull) reuses
    them instead of resuming their run, which a new commit would refuse. Per-class statistics scored with a tree
    chosen for the hardware (``aux_tree=auto``) are collected anew: that tree may differ here."""
    tree = drafter_class(cfg.method).tree_param
    if cfg.autotree.redo or (policy and tree and cfg.method.get(tree) == "auto"):
        return None
    dtype = models.resolve_dtype(cfg.dtype, models.resolve_device(cfg.device), cfg.model)
    path = statistics_paths(resolve_path(cfg.autotree.dir), cfg.model.name, str(dtype).removeprefix("torch."),
                            cfg.method, cfg.data.name, policy=policy, sampled=sampling_key(cfg))[0]
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if (raw.get("question_hashes") != question_hashes(datasets.load(cfg.data))
            or raw.get("provenance", {}).get("max_new_tokens") != cfg.max_new_tokens
            or any(raw.get(k) != v for k, v in expected.items())):
        return None
    print(f"acceptance: reusing {path} (autotree.redo=true collects anew)", file=sys.stderr)
    return path


def command(module: str, cfg: DictConfig, extra: str = "") -> str:
    """The command that makes a missing or refused file for ``cfg``'s setup."""
    threads = f" threads={cfg.threads}" if cfg.threads else ""
    return (f"python -m evaluation.{module} model={cfg.model.name} device={cfg.device} dtype={cfg.dtype}{threads}"
            f"{extra} autotree.dir={cfg.autotree.dir}")


def find_calibration(cfg: DictConfig, device: torch.device, dtype: torch.dtype) -> tuple[Calibration, Path]:
    """This machine's calibration for ``cfg`` (``autotree.calibration`` names one; it is still checked)."""
    key = machine_key(cfg.model.name, device, dtype)
    directory = resolve_path(cfg.autotree.dir)
    path = resolve_path(cfg.autotree.calibration) if cfg.autotree.calibration else calibration_path(directory, key)
    if not path.is_file():
        others = sorted(directory.glob("calibration-*.json"))
        near = ""
        if others:
            diffs = {str(p): key_diff(key, Calibration.load(p).key) for p in others}
            best = min(diffs, key=lambda p: len(diffs[p]))
            near = f" ({best} exists but differs in {'; '.join(diffs[best])})"
        raise AutoTreeError(f"tree=auto needs a calibration of this machine and no {path} exists{near}; make it "
                            f"with: {command('calibrate', cfg)}")
    calibration = Calibration.load(path)
    diff = key_diff(key, calibration.key)
    if diff:
        raise AutoTreeError(f"refusing calibration {path}: it was made for another setup, differing in "
                            f"{'; '.join(diff)}; calibrate this one with: {command('calibrate', cfg)}")
    return calibration, path


def statistics_key(cfg: DictConfig, method: DictConfig, dtype: str, policy: bool = False) -> dict:
    """What a statistics file is keyed by: model, dtype, the method's settings and, when it samples, the
    sampling settings (:func:`sampling_key`)."""
    sampled = sampling_key(cfg)
    settings = (policy_key if policy else method_key)(method, bool(sampled))
    key = {"model": cfg.model.name, "dtype": dtype, "method": settings}
    return {**key, "sampling": sampled} if sampled else key


def find_statistics(cfg: DictConfig, method: DictConfig, dtype: str, questions: list[dict],
                    policy: bool = False) -> tuple[Acceptance | PolicyStats, Path]:
    """The method's per-node statistics, or with ``policy`` its per-class ones, collected on other questions: those
    collected for the evaluated question set (its held-out split, ``<data>-heldout<N>``) before any other set's, then
    the most steps (a code workload's tree is not chosen from chat statistics because those had more steps)."""
    key = statistics_key(cfg, method, dtype, policy)
    evaluated = set(question_hashes(questions))
    if cfg.autotree.acceptance and not policy:
        candidates = [resolve_path(cfg.autotree.acceptance)]
    else:
        candidates = statistics_paths(resolve_path(cfg.autotree.dir), cfg.model.name, dtype, method, policy=policy)
    make = command("acceptance", cfg, f" method={method.name}{sampling_overrides(cfg)} data=<questions you do not "
                                      "evaluate>")
    what = f"method.{drafter_class(method).policy_param}=auto" if policy else "tree=auto"
    if not candidates or not candidates[0].is_file():
        raise AutoTreeError(f"{what} needs {'policy' if policy else 'acceptance'} statistics for {key} in "
                            f"{cfg.autotree.dir} and none exist; collect them with: {make}")
    usable, refused, passed_over = [], [], []  # passed over: the evaluated set's own files, refused
    own = re.compile(rf"-{re.escape(_name_part(cfg.data.name))}(-heldout\d+)?\.json$")  # the evaluated set's
    for path in candidates:
        stats = (PolicyStats if policy else Acceptance).load(path)
        diff = [f"{k} ({key.get(k)!r} vs {stats.key.get(k)!r})" for k in {**key, **stats.key}
                if key.get(k) != stats.key.get(k)]
        overlap = len(evaluated & set(stats.question_hashes))
        why = (f"{path} differs in {'; '.join(diff)}" if diff else
               f"{path} was collected on {overlap} of the questions evaluated here (its statistics would flatter "
               "the chosen tree)" if overlap and not cfg.autotree.allow_overlap else None)
        if why:
            refused.append(why)
            if own.search(path.name):
                passed_over.append(why)
        else:
            usable.append((bool(own.search(path.name)), stats.steps, str(path), stats, path))
    if not usable:
        raise AutoTreeError("refusing every acceptance statistics file: " + "; ".join(refused) +
                            f". Collect statistics on other questions with: {make} (or autotree.allow_overlap=true, "
                            "never for a published table)")
    own_set, *_, stats, path = max(usable)
    if not own_set and passed_over:  # the evaluated set's own statistics exist but cannot serve: say so, loudly
        print(f"draftbench: warning: {what} takes its statistics from another question set ({path.name}): "
              f"{'; '.join(passed_over)}. For this set's own, held out from the questions evaluated: {make}",
              file=sys.stderr)
    return stats, path


def find_drafting(cfg: DictConfig, device: torch.device, dtype: torch.dtype) -> tuple[DraftingCalibration, Path]:
    """The drafting calibration of ``cfg.method`` on this machine."""
    key = machine_key(cfg.model.name, device, dtype)
    settings = method_key(cfg.method)
    path = drafting_path(resolve_path(cfg.autotree.dir), key, cfg.method.name, settings)
    make = command("calibrate", cfg, f" method={cfg.method.name}")
    if not path.is_file():
        raise AutoTreeError(f"tree=auto for {cfg.method.name} weighs its drafter's own time per draft, and no "
                            f"{path} exists; measure it (2 minutes for SmolLM2 on a 2-core CPU, after the "
                            f"calibration) with: {make}")
    drafting = DraftingCalibration.load(path)
    diff = key_diff(key, drafting.key)
    if drafting.method != settings:  # the file name holds a digest of the settings; a renamed file could lie
        diff.append(f"method settings ({settings} vs {drafting.method})")
    if diff:
        raise AutoTreeError(f"refusing drafting calibration {path}: made for another setup, differing in "
                            f"{'; '.join(diff)}; measure this one with: {make}")
    return drafting, path

