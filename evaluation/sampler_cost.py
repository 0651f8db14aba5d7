"""Benchmark: what the choice rule costs per verification step, beside the step's forward (docs/sampling.md).

    python -m evaluation.sampler_cost model=smollm2-135m device=cpu threads=2

On the model's own logits (the last positions of the longest question's prompt, so that every row is a real
distribution), the median time of :meth:`methods.sampling.Sampling.choose` over a one-token step (the baseline's)
and over the rows of Token Recycling's 80-node tree (its depths: the noise of 7 positions), for greedy decoding and
for each sampling rule below; for scale, the engine's whole greedy step over as many tokens after that prompt.
A shared machine's timings are noisy: compare within one run.
"""

from __future__ import annotations

import statistics
import time

import hydra
import torch
from omegaconf import DictConfig

from evaluation import data as datasets
from evaluation import models
from methods.engine import Engine
from methods.sampling import Sampling
from methods.tree import Draft, from_rank_paths, load_template

RULES = (Sampling(), Sampling(1.0), Sampling(1.0, top_k=50), Sampling(0.7, top_p=0.9), Sampling(1.0, top_p=0.9))
TREE, REPEATS = "paper", 30


def _median_ms(run, device: torch.device, repeats: int) -> float:
    run()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(1000 * (time.perf_counter() - start))
    return statistics.median(times)


@hydra.main(version_base=None, config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    if cfg.threads:
        torch.set_num_threads(int(cfg.threads))
    device = models.resolve_device(cfg.device)
    loaded = models.load(cfg.model, device, models.resolve_dtype(cfg.dtype, device, cfg.model))
    shape, _ = from_rank_paths(load_template(TREE))
    longest = max(datasets.load(cfg.data), key=lambda q: len(q["turns"][0]))["turns"][0]
    prompt = models.prompt_ids(loaded.tokenizer, cfg.model.template, [{"role": "user", "content": longest}])
    if len(prompt) < shape.size:
        raise ValueError(f"the longest prompt of data={cfg.data.name} has {len(prompt)} tokens, fewer than the "
                         f"tree's {shape.size}: choose another data=")
    ids = torch.tensor([prompt], device=device)
    engine = Engine(loaded.model, loaded.eos_token_ids)
    cache, context = engine.new_cache(len(prompt) + shape.size), len(prompt) - 1
    steps = {}
    with torch.inference_mode():
        logits = loaded.model(input_ids=ids).logits[0, -shape.size :].contiguous()
        loaded.model(input_ids=ids[:, :context], use_cache=True, **{engine.cache_kw: cache})
        cache.commit(context)
        for name, draft in (("1 token", None), (f"{shape.size} tokens", Draft(ids[0, -shape.size + 1 :], shape))):
            def step(draft: Draft | None = draft) -> None:
                engine.verify(prompt[-1], context, draft, cache)
                cache.commit(context)
            steps[name] = _median_ms(step, device, REPEATS)
    depths = torch.tensor(shape.depth_list, device=device)
    span = max(shape.depth_list) + 1
    print(f"{cfg.model.name} {device} {loaded.model.dtype} threads={torch.get_num_threads()} vocab={logits.shape[-1]}, "
          f"context {context}: a greedy step over " + ", ".join(f"{k} {v:.2f} ms" for k, v in steps.items()))
    for rule in RULES:
        with torch.inference_mode():
            one = _median_ms(lambda: rule.choose(logits[:1], 0, 100), device, REPEATS)
            tree = _median_ms(lambda: rule.choose(logits, 0, 100, depths, span), device, REPEATS)
        print(f"  {rule.tag() or 'greedy':>10}: 1 token {one:.3f} ms, {shape.size} tokens {tree:.2f} ms")


if __name__ == "__main__":
    main()
