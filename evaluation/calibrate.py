"""Calibrate the device: the time of one verification step over q tokens, at several context lengths.

    python -m evaluation.calibrate model=smollm2-135m device=cpu dtype=float32 threads=2 [calibration.redo=true]

A step is timed as the engine runs it in a run: :meth:`Engine.verify` over a draft whose shape is the first
``q - 1`` nodes of the wide candidate tree, after a random prefix of each context length, into the engine's own
KV cache, with the deepest path of the draft holding the model's true continuation so that it is accepted and
moved into place (what every accepted path costs), no forward timer (its syncs are not in a run's step),
CUDA-synchronised on a GPU. Timing depends on the shapes, not on the weights' values.

Every repeat is kept. The sizes are timed in rounds (each round every size in ascending order, after an untimed
single-token step: a small block right after a large one runs slower on some CPUs), at least
``calibration.min_rounds`` of them; then, within ``calibration.budget_s``, more rounds for the points whose 90%
bootstrap interval is wider than ``calibration.target`` among the sizes plans choose between (a step at most
``calibration.decision_ratio`` times a single token's: larger blocks never pay). A reference point timed at the
start, the middle and the end says whether the machine's speed moved during the calibration.

The same file tells the engine how to pad blocks (:attr:`Calibration.padding`) and ``tree=auto`` what a tree
costs, with the uncertainty of both (:class:`~methods.costs.CostCurve`).

For a method whose drafter runs forwards of its own (``Drafter.drafting_cost``: EAGLE's head, one per
depth), ``method=<name>`` also measures the drafter's time per draft over trees of every depth, narrow
and wide, and fits :class:`~methods.tree_search.DraftCost` to it (:class:`DraftingCalibration`, its own
file beside the calibration, keyed by the machine and the method's settings): ``tree=auto`` adds it to
the step time of every tree it weighs.

``calibration.batch_sizes`` (default ``[1]``) adds, for every batch size B > 1 listed (and the run's own
``batch_size``), the same measurement of a batched step (:meth:`methods.batch.BatchEngine.verify`) over B rows, each
holding its own random prefix of the context length and verifying q tokens: ``tree=auto`` and SAM's ``mode=auto``
plan with it at that batch size. A calibration that lacks a batch size asked for gets it measured and added (the
sizes it holds are kept); its key lists the batch sizes it holds.

The file is keyed by what speed depends on (:func:`evaluation.store.machine_key`): device name, model, dtype,
torch threads, torch version, masked GQA and the calibration's format. It lives in ``autotree.dir`` (default
``results/calibration/``) with a plot of the step time over the single-token step time against q; rerunning with
the same key reuses it unless ``calibration.redo=true``.
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import hydra
import numpy as np
import torch
from omegaconf import DictConfig

from evaluation import models
from evaluation.build import build_drafter
from evaluation.results import environment
from evaluation.store import (Calibration, CalibrationError, DraftingCalibration, StoreError, calibration_path,
                              drafter_class, drafting_path, machine_key, method_key, stale, write_json)
from methods.batch import BatchEngine
from methods.costs import CostCurve
from methods.drafter import Drafter, Step
from methods.engine import Engine
from methods.paths import resolve_path
from methods.tree import Draft, from_rank_paths, load_template


BUSY = 0.05  # a reference step varying by more than this within its own repeats: another process shares the machine


@dataclass
class _Point:
    """The state one context length is timed in: its KV cache holding the prefix, the root, and a draft per size;
    for a batch size above 1, a batched engine whose every row holds a prefix of its own, and a root and a draft
    per row (``roots``, ``drafts[q][row]``)."""

    context: int
    cache: object
    root: int
    drafts: dict
    batch: BatchEngine | None = None
    roots: tuple[int, ...] = ()


def _points(engine: Engine, vocab: int, sizes: Sequence[int], contexts: Sequence[int], batch: int = 1) -> list[_Point]:
    """Per context: a random prefix in a cache of its own (per row of a batch), and per size a draft of the candidate
    tree's first ``q-1`` nodes whose deepest path (the last node's) is the model's greedy continuation, so that
    verifying it accepts that path and moves it into place, as a run's steps do."""
    candidate = load_template("wide")
    if max(sizes) - 1 > len(candidate):
        raise CalibrationError(f"calibration.sizes go up to {max(sizes)}, but the candidate tree has "
                               f"{len(candidate)} nodes; use sizes up to {len(candidate) + 1}")
    gen = torch.Generator().manual_seed(0)
    shapes = {q: from_rank_paths(candidate[: q - 1])[0] for q in sizes if q > 1}
    depth = max((max(shape.depth_list) for shape in shapes.values()), default=0)
    points = []
    for context in contexts:
        rows = BatchEngine(engine, batch) if batch > 1 else None
        roots, drafts = [], {q: [] for q in sizes}
        for row in range(batch):
            prefix = torch.randint(vocab, (context + 1,), generator=gen).tolist()
            truth = engine.generate(prefix, Drafter(vocab), depth + 1).output_ids if depth else []
            if rows is None:
                cache = engine.new_cache(context + max(sizes))
                with torch.inference_mode():
                    engine.model(input_ids=torch.tensor([prefix[:context]], device=engine.device), use_cache=True,
                                 logits_to_keep=1, **{engine.cache_kw: cache})
                cache.commit(context)
            else:
                rows.prefill(row, prefix[:context], Drafter(vocab), max_new_tokens=max(sizes))
                rows.rewind(row, context, prefix[context])
                cache = rows.cache
            roots.append(prefix[context])
            drafts[1].append(None)
            for q, shape in shapes.items():
                tokens = torch.randint(vocab, (q - 1,), generator=gen)
                path = shape.paths[-1]  # the last node's path: the deepest, usually not contiguous
                for d, node in enumerate(path[1:]):
                    tokens[node - 1] = truth[d] if d < len(truth) else tokens[node - 1]
                drafts[q].append(Draft(tokens.to(engine.device), shape))
        if rows is None:
            points.append(_Point(context, cache, roots[0], {q: d[0] for q, d in drafts.items()}))
        else:
            points.append(_Point(context, rows.cache, roots[0], drafts, rows, tuple(roots)))
    return points


def _time_step(engine: Engine, point: _Point, q: int) -> float:
    """One step over ``q`` tokens at ``point`` as a run makes it (ms); the cache is left as it was."""
    engine.sync()
    start = time.perf_counter()
    with torch.inference_mode():
        if point.batch is None:
            engine.verify(point.root, point.context, point.drafts[q], point.cache)
        else:
            point.batch.verify(dict(enumerate(point.drafts[q])))
    engine.sync()
    ms = 1000 * (time.perf_counter() - start)
    if point.batch is None:
        point.cache.commit(point.context)
    else:
        for row, root in enumerate(point.roots):
            point.batch.rewind(row, point.context, root)
    return ms


def _round(engine: Engine, point: _Point, sizes: Sequence[int], samples: dict) -> None:
    """Every size once, ascending, after an untimed single-token step."""
    _time_step(engine, point, 1)
    for q in sizes:
        samples[point.context, q].append(_time_step(engine, point, q))


def _reference(engine: Engine, point: _Point, repeats: int = 5) -> list[float]:
    """The drift reference: single-token steps at one context."""
    _time_step(engine, point, 1)
    return [_time_step(engine, point, 1) for _ in range(repeats)]


def measure(engine: Engine, vocab: int, sizes: Sequence[int], contexts: Sequence[int], min_rounds: int,
            budget_s: float, target: float, decision_ratio: float, progress: bool = True, batch: int = 1
            ) -> tuple[list[list[list[float]]], dict]:
    """Every repeat (ms) of ``engine.verify`` (over ``batch`` rows: the batched engine's) for every (context, q), and
    the drift check; see the module."""
    started = time.perf_counter()
    points = _points(engine, vocab, sizes, contexts, batch)
    samples: dict = {(c, q): [] for c in contexts for q in sizes}
    reference = points[len(points) // 2]
    drift = {"context": reference.context, "q": 1, "start": _reference(engine, reference)}
    for r in range(min_rounds + 1):  # the first round is a warm-up
        for point in points:
            _round(engine, point, sizes, samples)
        if r == 0:
            for key in samples:
                samples[key].clear()
    drift["middle"] = _reference(engine, reference)
    rounds = min_rounds
    while time.perf_counter() - started < budget_s:
        curve = CostCurve.from_samples(contexts, sizes, [[samples[c, q] for q in sizes] for c in contexts],
                                       replicates=100)
        wide = {}
        for i, point in enumerate(points):
            single = curve.fitted[i, 0]
            chosen = [q for j, q in enumerate(sizes) if curve.fitted[i, j] <= decision_ratio * single
                      and curve.precision[i, j] > target]
            if chosen:
                wide[i] = chosen
        if not wide:
            break
        for i, chosen in wide.items():
            _round(engine, points[i], chosen, samples)
        rounds += 1
    drift["end"] = _reference(engine, reference)
    drift |= _verdict(drift)
    table = [[samples[c, q] for q in sizes] for c in contexts]
    if progress:
        for c, row in zip(contexts, table):
            where = f"batch {batch}, context {c}" if batch > 1 else f"context {c}"
            print(f"calibrate: {where}: " + ", ".join(f"q={q} {statistics.mean(t):.1f} ms ({len(t)}x)"
                                                          for q, t in zip(sizes, row) if q in (1, 2, 4, 8, 16, 32, 128)),
                  file=sys.stderr)
    return table, drift | {"rounds": rounds, "seconds": round(time.perf_counter() - started, 1)}


def _verdict(drift: dict) -> dict:
    """How far the machine's speed moved between the start and the end, against the reference's own noise; a
    reference that varies widely within its own repeats means a busy machine, which is said too."""
    start, end = statistics.median(drift["start"]), statistics.median(drift["end"])
    spread = max(statistics.median(abs(t - start) for t in drift["start"]),
                 statistics.median(abs(t - end) for t in drift["end"])) / start
    moved = end / start - 1
    busy = spread > BUSY
    noisy = busy or abs(moved) > max(3 * spread, 0.02)
    where = f"(a single-token step at context {drift['context']}, start to end)"
    if busy:
        verdict = (f"the machine was busy: the reference step varied by +/-{100 * spread:.0f}% within its own repeats "
                   f"and moved {100 * moved:+.0f}% {where}; calibrate again on an idle machine")
    elif noisy:
        verdict = (f"the machine's speed moved by {100 * moved:+.1f}% during the calibration {where}: its times may be "
                   "off by as much; calibrate again on an idle machine")
    else:
        verdict = f"the machine's speed held during the calibration ({100 * moved:+.1f}% start to end, within noise)"
    return {"moved": round(moved, 4), "spread": round(spread, 4), "beyond_noise": noisy, "verdict": verdict}


class _Timed:
    """A drafter whose ``propose`` + ``observe`` per step are timed, synchronised; the rest passes through."""

    def __init__(self, drafter: Drafter, engine: Engine):
        self._drafter, self._engine = drafter, engine
        self.ms: list[float] = []
        self._proposing = 0.0

    def __getattr__(self, name: str) -> object:
        return getattr(self._drafter, name)

    def propose(self, ids: list[int]) -> Draft | None:
        self._engine.sync()
        start = time.perf_counter()
        draft = self._drafter.propose(ids)
        self._engine.sync()
        self._proposing = time.perf_counter() - start
        return draft

    def observe(self, step: Step) -> None:
        start = time.perf_counter()
        self._drafter.observe(step)
        self._engine.sync()
        self.ms.append(1000 * (self._proposing + time.perf_counter() - start))


def drafting_trees(candidate: Sequence[Sequence[int]]) -> list[list[list[int]]]:
    """The trees a drafting calibration times: per depth the rank-0 chain (fewest nodes to feed) and the
    candidate tree cut at that depth (most nodes), so that the fit separates depth from width."""
    trees = []
    for d in range(1, max(map(len, candidate)) + 1):
        trees.append([[0] * k for k in range(1, d + 1)])
        if d > 1:
            trees.append([list(p) for p in candidate if len(p) <= d])
    return trees


def measure_drafting(engine: Engine, build: Callable[[list[list[int]]], Drafter], vocab: int,
                     trees: Sequence[list[list[int]]], contexts: Sequence[int],
                     steps: int) -> list[list[float]]:
    """Median time (ms) of a drafter's ``propose`` + ``observe`` per step, for every (context, tree): real
    generations from a random prefix (EOS ignored), the first step (which catches up on the prompt) left out."""
    gen = torch.Generator().manual_seed(1)
    rows = []
    for context in contexts:
        prompt = torch.randint(vocab, (context,), generator=gen).tolist()
        row = []
        for paths in trees:
            timed = _Timed(build(paths), engine)
            engine.generate(prompt, timed, 2 * steps + 2)  # a step emits at least one token
            row.append(statistics.mean(timed.ms[1 : steps + 1] or timed.ms))
        print(f"calibrate: drafting at context {context}: " + ", ".join(f"{t:.1f}" for t in row) + " ms",
              file=sys.stderr)
        rows.append(row)
    return rows


def plot(calibration: Calibration, path: Path) -> None:
    """Step time over the single-token step time against q, one line per context length, with the 90% interval
    (dashed: fitted over contexts)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.5, 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    curve = calibration.curve
    low, high = np.quantile(curve.replicates, [0.05, 0.95], axis=0)
    for i, (context, row) in enumerate(zip(calibration.contexts, calibration.samples_ms)):
        means = [statistics.mean(point) for point in row]
        line, = ax.plot(calibration.sizes, [t / means[0] for t in means], marker=".", label=f"context {context}")
        fit = curve.fitted[i]
        ax.plot(calibration.sizes, fit / fit[0], linestyle="--", color=line.get_color(), alpha=0.6)
        ax.fill_between(calibration.sizes, low[i] / fit[0], high[i] / fit[0], color=line.get_color(), alpha=0.15)
    ax.set_xlabel("tokens verified per step (q, root included)")
    ax.set_ylabel("step time / step time at q=1 (dashed: fitted; band: 90%)")
    key = calibration.key
    ax.set_title(f"{key['model']} {key['dtype']}, {key['threads']} threads\n{key['device_name']}", fontsize="medium")
    ax.grid(alpha=0.3)
    ax.legend(frameon=False)
    fig.savefig(path, dpi=150)


def calibrate(cfg: DictConfig) -> Path:
    """Measure (or reuse) the calibration for ``cfg``'s model, device, dtype and threads, and for a method
    whose drafter has a drafting cost, its drafting calibration; returns the calibration's file."""
    if cfg.threads:
        torch.set_num_threads(int(cfg.threads))
    device = models.resolve_device(cfg.device)
    dtype = models.resolve_dtype(cfg.dtype, device, cfg.model)
    key = machine_key(cfg.model.name, device, dtype)
    directory = resolve_path(cfg.autotree.dir)
    path = calibration_path(directory, key)
    drafting = None
    if drafter_class(cfg.method).drafting_cost:
        drafting = drafting_path(directory, key, cfg.method.name, method_key(cfg.method))
    wanted = sorted({int(b) for b in cfg.calibration.batch_sizes} | {int(cfg.batch_size)})
    if min(wanted) < 1:
        raise CalibrationError(f"calibration.batch_sizes and batch_size must be at least 1, got {wanted}")
    base = None if cfg.calibration.redo or stale(path, Calibration, key) else Calibration.load(path)
    batches = [b for b in wanted if b > 1 and (base is None or b not in base.batch_sizes)]
    steps = base is None or bool(batches)
    drafter = drafting is not None and (cfg.calibration.redo or stale(drafting, DraftingCalibration, key))
    for done in [p for p, todo in ((path, steps), (drafting, drafter)) if p is not None and not todo]:
        print(f"calibrate: reusing {done} (calibration.redo=true measures anew)", file=sys.stderr)
    if not (steps or drafter):
        return path
    loaded = models.load(cfg.model, device, dtype)
    if steps:
        _calibrate_steps(cfg, loaded, key, path, base, batches)
    if drafter:
        _calibrate_drafting(cfg, loaded, key, drafting)
    return path


def _provenance(device: torch.device, started: float, **facts: object) -> dict:
    return {**environment(device), **facts, "seconds": round(time.time() - started, 1),
            "measured": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def _calibrate_steps(cfg: DictConfig, loaded: models.LoadedModel, key: dict, path: Path, base: Calibration | None,
                     batches: Sequence[int]) -> None:
    """Measure the single-sequence step (unless ``base`` holds it) and the batched step at ``batches``."""
    engine = Engine(loaded.model, loaded.eos_token_ids)
    c = cfg.calibration
    if base is None:
        limit = engine.max_length or max(c.contexts) + max(c.sizes)
        contexts = sorted(x for x in c.contexts if x + max(c.sizes) <= limit)
        if not contexts:
            raise CalibrationError(f"every calibration.contexts entry leaves no room for q={max(c.sizes)} "
                                   f"within the model's {limit} positions; list shorter contexts")
        sizes = sorted(set(c.sizes) | {1})
    else:  # a batch size added to a calibration: on its grid
        contexts, sizes = list(base.contexts), list(base.sizes)
    runs = ([] if base is not None else [1]) + list(batches)
    print(f"calibrate: {key} -> {path}; batch sizes {runs}, about {c.budget_s:.0f} s each (calibration.budget_s)",
          file=sys.stderr)
    started = time.time()
    vocab = loaded.model.get_output_embeddings().weight.shape[0]
    measured = {b: measure(engine, vocab, sizes, contexts, c.min_rounds, c.budget_s, c.target, c.decision_ratio,
                           batch=b) for b in runs}
    nested = lambda table: tuple(tuple(tuple(p) for p in row) for row in table)  # noqa: E731
    if base is None:
        samples, drift = measured.pop(1)
        provenance = _provenance(engine.device, started, min_rounds=c.min_rounds, budget_s=c.budget_s, target=c.target)
        held = {}
    else:
        samples, drift, provenance, held = base.samples_ms, base.drift, base.provenance, dict(base.batches)
    added = {b: {"samples_ms": nested(t), "drift": d | {"measured": time.strftime("%Y-%m-%dT%H:%M:%S%z")}}
             for b, (t, d) in measured.items()}
    calibration = Calibration(key=key, contexts=tuple(contexts), sizes=tuple(sizes), samples_ms=nested(samples),
                              drift=drift, provenance=provenance, batches=held | added)
    write_json(path, calibration.to_json())
    plot(calibration, path.with_suffix(".png"))
    print(f"calibrate: {calibration.summary()}; wrote {path} and {path.with_suffix('.png').name}", file=sys.stderr)
    if drift["beyond_noise"] or calibration.curve.describe()["median_half_interval"] > BUSY:
        print("calibrate: warning: this calibration is imprecise (see above); plans made from it will say so in "
              "their intervals. Measure again on an idle machine: python -m evaluation.calibrate ... calibration.redo=true",
              file=sys.stderr)


def _calibrate_drafting(cfg: DictConfig, loaded: models.LoadedModel, key: dict, path: Path) -> None:
    cls = drafter_class(cfg.method)
    vocab = loaded.model.get_output_embeddings().weight.shape[0]
    engine = Engine(loaded.model, set(), time_forward=False)  # no EOS: every generation runs its steps
    trees = drafting_trees(load_template(cls.candidate_tree))
    depth = max(map(len, trees[-1]))
    room = 2 * cfg.calibration.drafting_steps + 2 + depth + 1  # the tokens generated after the prefix, and a tree
    limit = engine.max_length or max(cfg.calibration.drafting_contexts) + room
    contexts = sorted(c for c in cfg.calibration.drafting_contexts if c + room <= limit)
    if not contexts:
        raise CalibrationError(f"every calibration.drafting_contexts entry leaves no room for {room} more tokens "
                               f"within the model's {limit} positions; list shorter contexts")
    print(f"calibrate: drafting of {cfg.method.label}, {len(trees)} trees up to depth {depth} -> {path}", file=sys.stderr)
    started = time.time()
    draft_ms = measure_drafting(engine, lambda paths: build_drafter(cfg.method, vocab, engine.device,
                                                                    **{cls.tree_param: paths}),
                                len(loaded.tokenizer), trees, contexts, cfg.calibration.drafting_steps)
    shapes = []
    for paths in trees:
        shape, _ = from_rank_paths(paths)
        shapes.append((max(shape.depth_list), len({p for p in shape.parents if p > 0})))
    result = DraftingCalibration(key=key, method=method_key(cfg.method),
                                 contexts=tuple(contexts), trees=tuple(shapes),
                                 draft_ms=tuple(map(tuple, draft_ms)),
                                 provenance=_provenance(engine.device, started, label=cfg.method.label,
                                                        steps=cfg.calibration.drafting_steps))
    write_json(path, result.to_json())
    fits = ", ".join(f"context {c}: {1000 * f.base:.1f} + {1000 * f.per_level:.1f}/depth + {1000 * f.per_node:.2f}/node ms"
                     for c, f in zip(result.contexts, result.fitted))
    print(f"calibrate: drafting cost {fits}; wrote {path}", file=sys.stderr)


@hydra.main(version_base=None, config_path="../conf", config_name="calibrate")
def main(cfg: DictConfig) -> None:
    try:
        calibrate(cfg)
    except StoreError as err:
        sys.exit(f"calibrate: error: {err}")


if __name__ == "__main__":
    main()
