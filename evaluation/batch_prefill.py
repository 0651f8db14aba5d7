"""Prefill the rows of a batch one by one or together: which is faster on this machine (docs/batching.md).

    python -m evaluation.batch_prefill model=smollm2-135m data=spec_bench data.per_category=10 batch_size=4 threads=2

The batched engine (methods.batch) prefills a row alone when it starts: with continuous batching rows start at
different steps, and a batch-1 prefill gives a row exactly batch 1's KV entries and first token. Where B rows start
together (a run's first B questions, or rows that end in the same step), one forward could prefill them all, each
prompt right-padded to the longest with a mask, so that every row's entries lie at ``[0, P_b)`` as the engine's
layout wants. This times both on the first turns of the data, B consecutive questions at a time, in turn (one by
one, then together, ``repeats`` times), and prints the median of each, their ratio, and how many rows' first tokens
the padded prefill changed (a forward over B rows of another length may round differently). A benchmark: run it on
an otherwise idle machine.
"""

from __future__ import annotations

import statistics
import sys
import time

import hydra
import torch
from omegaconf import DictConfig

from evaluation import data as datasets
from evaluation import models
from methods.batch import BatchEngine
from methods.drafter import Drafter
from methods.engine import Engine


def one_by_one(batch: BatchEngine, prompts: list[list[int]], vocab: int) -> list[int]:
    """Every prompt prefilled alone into its row (what the engine does); the first tokens."""
    return [batch.prefill(row, prompt, Drafter(vocab)).output_ids[0] for row, prompt in enumerate(prompts)]


@torch.inference_mode()
def together(batch: BatchEngine, prompts: list[list[int]]) -> list[int]:
    """Every prompt in one forward, right-padded to the longest (a row sees its own prompt only, causally); the
    first tokens (greedy)."""
    eng = batch.engine
    rows, width = len(prompts), max(map(len, prompts))
    ids = torch.zeros(rows, width, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, : len(prompt)] = torch.tensor(prompt)
    lengths = torch.tensor([len(p) for p in prompts])
    keys = torch.arange(width)
    visible = (keys[None, None, :] <= keys[None, :, None]) & (keys[None, None, :] < lengths[:, None, None])
    mask = torch.zeros(visible.shape, dtype=eng.dtype).masked_fill_(~visible, eng._min)[:, None]
    for row in range(rows):
        batch.rewind(row, 0, 0)
    batch.cache.reserve(width + 64)
    last = sorted(set((lengths - 1).tolist()))
    out = eng.model(input_ids=ids.to(eng.device), position_ids=keys.expand(rows, -1).to(eng.device),
                    attention_mask=mask.to(eng.device), use_cache=True,
                    logits_to_keep=torch.tensor(last, device=eng.device), **{eng.cache_kw: batch.cache})
    first = out.logits[torch.arange(rows), [last.index(n - 1) for n in lengths.tolist()]].argmax(-1).tolist()
    for row, prompt in enumerate(prompts):
        batch.rewind(row, len(prompt), first[row])
    return first


def _timed(engine: Engine, work) -> tuple[float, list[int]]:
    engine.sync()
    start = time.perf_counter()
    result = work()
    engine.sync()
    return 1000 * (time.perf_counter() - start), result


def compare(engine: Engine, batch_size: int, prompts: list[list[int]], repeats: int = 3) -> dict:
    """Median ms per group of ``batch_size`` prompts one by one and together, and the rows whose first token the
    padded prefill changed."""
    batch = BatchEngine(engine, batch_size)
    vocab = engine.model.get_output_embeddings().weight.shape[0]
    groups = [prompts[i : i + batch_size] for i in range(0, len(prompts) - batch_size + 1, batch_size)]
    alone, padded, changed = [], [], 0
    together(batch, groups[0])  # warm-up: both paths, untimed
    one_by_one(batch, groups[0], vocab)
    for group in groups:
        for _ in range(repeats):
            ms, want = _timed(engine, lambda: one_by_one(batch, group, vocab))
            alone.append(ms)
            ms, got = _timed(engine, lambda: together(batch, group))
            padded.append(ms)
        changed += sum(a != b for a, b in zip(want, got))
    one, all_ = statistics.median(alone), statistics.median(padded)
    return {"batch_size": batch_size, "groups": len(groups), "repeats": repeats, "one_by_one_ms": one,
            "together_ms": all_, "together_over_one_by_one": all_ / one, "first_tokens_changed": changed}


@hydra.main(version_base=None, config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    if cfg.threads:
        torch.set_num_threads(int(cfg.threads))
    if cfg.batch_size < 2:
        sys.exit("batch_prefill: give batch_size=B with B >= 2 (the rows prefilled together)")
    device = models.resolve_device(cfg.device)
    loaded = models.load(cfg.model, device, models.resolve_dtype(cfg.dtype, device, cfg.model))
    prompts = [models.prompt_ids(loaded.tokenizer, cfg.model.template, [{"role": "user", "content": q["turns"][0]}])
               for q in datasets.load(cfg.data)]
    result = compare(Engine(loaded.model, loaded.eos_token_ids), int(cfg.batch_size), prompts)
    print(f"batch_prefill: {result['groups']} groups of {result['batch_size']} prompts, {result['repeats']} repeats: "
          f"one by one {result['one_by_one_ms']:.1f} ms, together (right-padded) {result['together_ms']:.1f} ms "
          f"(x{result['together_over_one_by_one']:.2f}); first tokens changed by the padded prefill: "
          f"{result['first_tokens_changed']}")


if __name__ == "__main__":
    main()
