"""Calibrate the device: the time of one verification step over q tokens, at several context lengths.

    python -m evaluation.calibrate model=smollm2-135m device=cpu dtype=float32 threads=2 [calibration.redo=true]

A step is the engine's own :meth:`Engine.verify` (tree mask, forward, acceptance, KV compaction) on a
random draft whose shape is the first ``q - 1`` nodes of the wide candidate tree, after a random
prefix of each context length; warm, median of repeats, CUDA-synchronised on a GPU. The forward's
share is timed apart, so the engine's time outside the model forward is recorded too. Timing does not
depend on the weights' values, only on the shapes.

The same file tells the engine how to pad blocks (:attr:`Calibration.padding`: a q whose larger
neighbour runs faster is fed as that size) and ``tree=auto`` what a tree costs.

For a method whose drafter runs forwards of its own (``Drafter.drafting_cost``: EAGLE's head, one per
depth), ``method=<name>`` also measures the drafter's time per draft over trees of every depth, narrow
and wide, and fits :class:`~methods.tree_search.DraftCost` to it (:class:`DraftingCalibration`, its own
file beside the calibration, keyed by the machine and the method's settings): ``tree=auto`` adds it to
the step time of every tree it weighs.

The file is keyed by what speed depends on: device name, model, dtype, torch threads and torch
version. It lives in ``autotree.dir`` (default ``results/calibration/``) with a plot of the step time
over the single-token step time against q; rerunning with the same key reuses it unless
``calibration.redo=true``. ``method.tree=auto`` reads it (evaluation.autotree).
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Sequence

import hydra
import torch
from omegaconf import DictConfig

from evaluation import models
from evaluation.build import build_drafter
from evaluation.results import environment
from evaluation.store import (Calibration, CalibrationError, DraftingCalibration, StoreError, calibration_path,
                              drafter_class, drafting_path, machine_key, method_key, stale, write_json)
from methods.drafter import Drafter, Step
from methods.engine import Engine
from methods.paths import resolve_path
from methods.tree import Draft, from_rank_paths, load_template


def measure(engine: Engine, vocab: int, sizes: Sequence[int], contexts: Sequence[int], repeats: int,
            progress: bool = True) -> tuple[list[list[float]], list[list[float]]]:
    """Median step and forward times (ms) of ``engine.verify`` for every (context, q)."""
    candidate = load_template("wide")
    if max(sizes) - 1 > len(candidate):
        raise CalibrationError(f"calibration.sizes go up to {max(sizes)}, but the candidate tree has "
                               f"{len(candidate)} nodes; use sizes up to {len(candidate) + 1}")
    gen = torch.Generator().manual_seed(0)
    shapes = {q: from_rank_paths(candidate[: q - 1])[0] for q in sizes if q > 1}
    step_ms, forward_ms = [], []
    for context in contexts:
        cache = engine.new_cache(context + max(sizes))
        prefix = torch.randint(vocab, (1, context), generator=gen).to(engine.device)
        with torch.inference_mode():
            engine.model(input_ids=prefix, use_cache=True, logits_to_keep=1, **{engine.cache_kw: cache})
        cache.commit(context)
        drafts = {q: None if q == 1 else Draft(torch.randint(vocab, (q - 1,), generator=gen).to(engine.device), shapes[q])
                  for q in sizes}
        totals: dict[int, list[float]] = {q: [] for q in sizes}
        inner: dict[int, list[float]] = {q: [] for q in sizes}
        # Rounds over every size, not repeats of one size in a row: a machine whose speed drifts (a shared
        # host) then shifts every size alike, and the median of the rounds keeps the curve's shape. Each timed
        # step follows an untimed one of its own size, as in a run, whose steps verify blocks of similar sizes:
        # right after a large block a small one runs slower (measured on an Intel Xeon: a single token 4-7% slower
        # after 80 tokens), and timing q=1 after q=128 had made 1-3 tokens look equally dear there.
        for r in range(repeats + 1):  # the first round is a warm-up
            for q in sizes:
                with torch.inference_mode():
                    engine.verify(int(prefix[0, -1]), context, drafts[q], cache)
                cache.commit(context)
                engine.forward_time = 0.0
                engine.sync()
                start = time.perf_counter()
                with torch.inference_mode():
                    engine.verify(int(prefix[0, -1]), context, drafts[q], cache)
                engine.sync()
                if r:
                    totals[q].append(1000 * (time.perf_counter() - start))
                    inner[q].append(1000 * engine.forward_time)
                cache.commit(context)
        steps = [statistics.median(totals[q]) for q in sizes]
        forwards = [statistics.median(inner[q]) for q in sizes]
        if progress:
            print(f"calibrate: context {context}: " + ", ".join(f"q={q} {t:.1f} ms" for q, t in
                                                                 zip(sizes, steps) if q in (1, 8, 32, 128)),
                  file=sys.stderr)
        step_ms.append(steps)
        forward_ms.append(forwards)
    return step_ms, forward_ms


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
            row.append(statistics.median(timed.ms[1 : steps + 1] or timed.ms))
        print(f"calibrate: drafting at context {context}: " + ", ".join(f"{t:.1f}" for t in row) + " ms",
              file=sys.stderr)
        rows.append(row)
    return rows


def plot(calibration: Calibration, path: Path) -> None:
    """Step time over the single-token step time against q, one line per context length."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.5, 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for context, row, fit in zip(calibration.contexts, calibration.step_ms, calibration.fitted_ms):
        line, = ax.plot(calibration.sizes, [t / row[0] for t in row], marker=".", label=f"context {context}")
        ax.plot(calibration.sizes, [t / fit[0] for t in fit], linestyle="--", color=line.get_color(), alpha=0.6)
    ax.set_xlabel("tokens verified per step (q, root included)")
    ax.set_ylabel("step time / step time at q=1 (dashed: fitted over contexts)")
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
    steps = cfg.calibration.redo or stale(path, Calibration, key)
    drafter = drafting is not None and (cfg.calibration.redo or stale(drafting, DraftingCalibration, key))
    for done in [p for p, todo in ((path, steps), (drafting, drafter)) if p is not None and not todo]:
        print(f"calibrate: reusing {done} (calibration.redo=true measures anew)", file=sys.stderr)
    if not (steps or drafter):
        return path
    loaded = models.load(cfg.model, device, dtype)
    if steps:
        _calibrate_steps(cfg, loaded, key, path)
    if drafter:
        _calibrate_drafting(cfg, loaded, key, drafting)
    return path


def _provenance(device: torch.device, started: float, **facts: object) -> dict:
    return {**environment(device), **facts, "seconds": round(time.time() - started, 1),
            "measured": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def _calibrate_steps(cfg: DictConfig, loaded: models.LoadedModel, key: dict, path: Path) -> None:
    engine = Engine(loaded.model, loaded.eos_token_ids, time_forward=True)
    limit = engine.max_length or max(cfg.calibration.contexts) + max(cfg.calibration.sizes)
    contexts = sorted(c for c in cfg.calibration.contexts if c + max(cfg.calibration.sizes) <= limit)
    if not contexts:
        raise CalibrationError(f"every calibration.contexts entry leaves no room for q={max(cfg.calibration.sizes)} "
                               f"within the model's {limit} positions; list shorter contexts")
    sizes = sorted(set(cfg.calibration.sizes) | {1})
    print(f"calibrate: {key} -> {path}", file=sys.stderr)
    started = time.time()
    step_ms, forward_ms = measure(engine, len(loaded.tokenizer), sizes, contexts, cfg.calibration.repeats)
    calibration = Calibration(key=key, contexts=tuple(contexts), sizes=tuple(sizes),
                              step_ms=tuple(map(tuple, step_ms)), forward_ms=tuple(map(tuple, forward_ms)),
                              provenance=_provenance(engine.device, started, repeats=cfg.calibration.repeats))
    write_json(path, calibration.to_json())
    plot(calibration, path.with_suffix(".png"))
    outside = [1 - f / s for fs, ss in zip(forward_ms, step_ms) for f, s in zip(fs, ss)]
    print(f"calibrate: engine time outside the forward: {100 * min(outside):.1f}-{100 * max(outside):.1f}% of a "
          f"step; wrote {path} and {path.with_suffix('.png').name}", file=sys.stderr)


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
