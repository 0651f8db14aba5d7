"""Benchmark: our baseline loop against transformers' ``model.generate`` (greedy) on the same prompts.

Speedups are only honest if the baseline is as fast as the library's own greedy decoding. Both run
interleaved in one process on the first turn of every selected question, stop at the same EOS
tokens and budget, and must produce the same tokens; the ratio of total tokens/s is printed.

    python -m evaluation.loop_vs_generate data.limit=8 max_new_tokens=64
"""

from __future__ import annotations

import sys
import time

import hydra
import torch
from omegaconf import DictConfig

from evaluation import data as datasets
from evaluation import models
from methods.drafter import Drafter
from methods.engine import Engine


def _timed_generate(model, prompt: list[int], eos: list[int], max_new_tokens: int) -> tuple[list[int], float]:
    ids = torch.tensor([prompt], device=model.device)
    if model.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                         eos_token_id=eos, pad_token_id=eos[0], top_p=None, top_k=None, temperature=None)
    if model.device.type == "cuda":
        torch.cuda.synchronize()
    return out[0, len(prompt):].tolist(), time.perf_counter() - start


@hydra.main(version_base=None, config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    if cfg.threads:
        torch.set_num_threads(int(cfg.threads))
    questions = datasets.load(cfg.data)
    device = models.resolve_device(cfg.device)
    loaded = models.load(cfg.model, device, models.resolve_dtype(cfg.dtype, device, cfg.model))
    engine = Engine(loaded.model, loaded.eos_token_ids)
    eos = sorted(loaded.eos_token_ids)
    baseline = Drafter(loaded.model.get_output_embeddings().weight.shape[0], device)
    prompts = [models.prompt_ids(loaded.tokenizer, cfg.model.template, [{"role": "user", "content": q["turns"][0]}])
               for q in questions]
    for _ in range(cfg.warmup):
        engine.generate(prompts[0], baseline, cfg.max_new_tokens)
        _timed_generate(loaded.model, prompts[0], eos, cfg.max_new_tokens)
    ours_tokens = ours_time = hf_tokens = hf_time = 0.0
    same = 0
    for prompt in prompts:  # interleaved, so that drift in machine speed hits both alike
        gen = engine.generate(prompt, baseline, cfg.max_new_tokens)
        hf_ids, seconds = _timed_generate(loaded.model, prompt, eos, cfg.max_new_tokens)
        ours_tokens, ours_time = ours_tokens + len(gen.output_ids), ours_time + gen.wall_time
        hf_tokens, hf_time = hf_tokens + len(hf_ids), hf_time + seconds
        same += gen.output_ids == hf_ids
    ours, hf = ours_tokens / ours_time, hf_tokens / hf_time
    print(f"{cfg.model.name} {device} {loaded.model.dtype} threads={torch.get_num_threads()} "
          f"prompts={len(prompts)} max_new_tokens={cfg.max_new_tokens}")
    print(f"draftbench baseline loop: {ours:.2f} tok/s   model.generate: {hf:.2f} tok/s   ratio {ours / hf:.3f}   "
          f"identical outputs {same}/{len(prompts)}")
    if same != len(prompts):
        print("warning: outputs differ between the two loops", file=sys.stderr)


if __name__ == "__main__":
    main()
