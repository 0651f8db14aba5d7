"""A drafter's own time per decoding step, without a model: ``python -m evaluation.drafter_time method=sam``.

The context is a synthetic token stream that reuses phrases (so retrieval finds matches); the "model" is an
oracle that continues the stream (the accepted path is the draft's longest path that agrees with it) and
returns random logits. Only the drafter is timed, in CPU time of this process (robust to other load on a
shared machine; give ``threads=1``): ``propose`` and ``observe`` per step, ``reset`` (the prompt) per
generation. A drafter whose tree changes from step to step also gets the cost of its shapes'
device buffers, built fresh every step versus interned (``methods.tree.interned``).

    python -m evaluation.drafter_time method=sam method.mode=merge +vocab=49152 +prompt=1000 +steps=400 threads=1
"""

from __future__ import annotations

import random
import time

import hydra
import torch
from omegaconf import DictConfig

from evaluation.build import build_drafter
from methods.drafter import Drafter, Step
from methods.tree import Draft, TreeShape, chain, interned


def synthetic_stream(vocab: int, length: int, seed: int) -> list[int]:
    """Random phrases of 2..24 tokens drawn from a pool of 64, so that the stream often repeats itself."""
    rng = random.Random(seed)
    pool = [[rng.randrange(vocab) for _ in range(rng.randint(2, 24))] for _ in range(64)]
    stream: list[int] = []
    while len(stream) < length:
        stream += rng.choice(pool) if rng.random() < 0.7 else [rng.randrange(vocab)]
    return stream[:length]


def oracle_step(draft: Draft | None, ids: list[int], truth: list[int], logits: torch.Tensor) -> Step:
    """The step a model continuing ``truth`` would produce: the longest agreeing path, then the bonus token."""
    tokens = [ids[-1]] + (draft.tokens.tolist() if draft is not None else [])
    parents = draft.shape.parents if draft is not None else ()
    n = len(ids)
    path = [0]
    for i, p in enumerate(parents, start=1):
        if p == path[-1] and len(path) - 1 + n < len(truth) and tokens[i] == truth[len(path) - 1 + n]:
            path.append(i)
    emitted = truth[n : n + len(path)]
    block = torch.tensor(tokens)
    size = len(tokens)
    return Step(position=n - 1, shape=draft.shape if draft is not None else chain(0), tokens=block,
                logits=logits[:size], predictions=logits[:size].argmax(-1), accepted=torch.tensor(path),
                emitted=emitted, hidden_states=None)


@hydra.main(version_base=None, config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    if cfg.threads:
        torch.set_num_threads(int(cfg.threads))
    vocab, prompt_len, steps = int(cfg.get("vocab", 49152)), int(cfg.get("prompt", 1000)), int(cfg.get("steps", 400))
    drafter: Drafter = build_drafter(cfg.method, vocab, torch.device("cpu"))
    truth = synthetic_stream(vocab, prompt_len + 8 * steps + 64, cfg.seed)
    logits = torch.randn(256, vocab)
    start = time.process_time()
    drafter.reset(torch.tensor(truth[:prompt_len]), logits[:1].expand(prompt_len, -1) if drafter.needs_prefill_logits else None)
    reset = time.process_time() - start
    ids = truth[: prompt_len + 1]
    proposing = observing = 0.0
    shapes: list[tuple[int, ...]] = []
    for _ in range(steps):
        start = time.process_time()
        draft = drafter.propose(ids)
        proposing += time.process_time() - start
        step = oracle_step(draft, ids, truth, logits)
        start = time.process_time()
        drafter.observe(step)
        observing += time.process_time() - start
        ids += step.emitted
        if draft is not None:
            shapes.append(draft.shape.parents)
    mat = (len(ids) - prompt_len - 1) / steps
    print(f"{cfg.method.label}: vocab {vocab}, prompt {prompt_len}, {steps} steps, {len(ids) - prompt_len - 1} tokens "
          f"(MAT {mat:.2f} against the oracle), torch threads {torch.get_num_threads()}")
    print(f"  reset {reset * 1e3:.2f} ms per generation ({reset / prompt_len * 1e6:.2f} us per prompt token); per step: "
          f"propose {proposing / steps * 1e6:.0f} us, observe {observing / steps * 1e6:.0f} us")
    if hasattr(drafter, "sources"):
        print(f"  sources {dict(drafter.sources)}")
    distinct = set(shapes)
    if len(distinct) > 1:
        fresh, cached = _buffer_cost(shapes)
        print(f"  {len(distinct)} distinct shapes; device buffers per step: fresh {fresh * 1e6:.0f} us, "
              f"interned {cached * 1e6:.1f} us")


def _buffer_cost(shapes: list[tuple[int, ...]]) -> tuple[float, float]:
    """Seconds per step to get a shape's buffers: a new TreeShape every step, versus the interned one."""
    device, dtype = torch.device("cpu"), torch.float32
    start = time.process_time()
    for parents in shapes:
        TreeShape(parents).buffers(device, dtype)
    fresh = (time.process_time() - start) / len(shapes)
    start = time.process_time()
    for parents in shapes:
        interned(parents).buffers(device, dtype)
    return fresh, (time.process_time() - start) / len(shapes)


if __name__ == "__main__":
    main()
