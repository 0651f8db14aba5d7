"""Self-distilled training data for an EAGLE head: the target answers the training prompts (batched greedy
decoding) and the same forwards give its last-layer features, stored in half precision, shard by shard.

One pass does both: the prefill gives the prompt's features and every decode step the new token's, so no
teacher-forced forward is run again (left padding changes them only by floating-point noise). A shard is
written once, complete, under a temporary name and renamed, so an interrupted run resumes at the first
missing shard and never reads a half-written one.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import torch
from safetensors.torch import load_file, save_file
from transformers import DynamicCache, PreTrainedModel

from methods.engine import cache_keyword


@dataclass
class Example:
    """One conversation: ``tokens`` [n] (prompt, then the answer from ``start``) and the target's features
    [n - 1, h] at every position but the last (the last token was never fed)."""

    index: int  # the prompt's index in the prompt list (held-out split and provenance)
    tokens: torch.Tensor
    features: torch.Tensor
    start: int


@torch.inference_mode()
def generate_batch(model: PreTrainedModel, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                   eos: set[int], pad: int) -> list[tuple[list[int], torch.Tensor]]:
    """Greedy answers to ``prompts`` (left-padded, one batch) and the features of prompt + answer.

    Returns per prompt the answer ids (up to and including the first stop token) and the features of every
    token fed, [len(prompt) + len(answer) - 1, h] in half precision."""
    device = model.device
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad, dtype=torch.long, device=device)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt, device=device)
        mask[row, width - len(prompt):] = 1
    base, lm_head = model.base_model, model.get_output_embeddings()
    cache = {cache_keyword(base.forward): DynamicCache()}
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    hidden = base(input_ids=ids, attention_mask=mask, position_ids=positions, **cache, use_cache=True).last_hidden_state
    features = [hidden.half()]
    answers = torch.empty(len(prompts), 0, dtype=torch.long, device=device)
    done = torch.zeros(len(prompts), dtype=torch.bool, device=device)
    stops = torch.tensor(sorted(eos), device=device)
    for _ in range(max_new_tokens):
        token = lm_head(hidden[:, -1]).argmax(-1)
        answers = torch.cat([answers, token[:, None]], 1)
        done |= torch.isin(token, stops)
        if bool(done.all()) or answers.shape[1] == max_new_tokens:
            break
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
        positions = positions[:, -1:] + 1
        hidden = base(input_ids=token[:, None], attention_mask=mask, position_ids=positions, **cache,
                      use_cache=True).last_hidden_state
        features.append(hidden.half())
    features = torch.cat(features, 1)  # [B, width + steps, h]: the last emitted token's feature is not computed
    out = []
    for row, prompt in enumerate(prompts):
        answer = answers[row].tolist()
        stop = next((i for i, t in enumerate(answer) if t in eos), None)
        answer = answer[: stop + 1] if stop is not None else answer
        # positions width - len(prompt) .. : the prompt, then the answer tokens fed so far
        n = len(prompt) + len(answer) - 1  # features exist for every token that was fed
        out.append((answer, features[row, width - len(prompt): width - len(prompt) + n].cpu()))
    return out


def write_shard(path: Path, examples: Sequence[Example]) -> None:
    """One shard: tokens and features of all its examples, concatenated, with the tokens' offsets (an
    example has one feature fewer than tokens)."""
    lengths = [len(e.tokens) for e in examples]
    tensors = {
        "tokens": torch.cat([e.tokens for e in examples]).to(torch.int32),
        "features": torch.cat([e.features for e in examples]).half(),
        "offsets": torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64),
        "starts": torch.tensor([e.start for e in examples], dtype=torch.int64),
        "index": torch.tensor([e.index for e in examples], dtype=torch.int64),
    }
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp))
    tmp.replace(path)


def read_shards(directory: Path) -> Iterator[Example]:
    for path in sorted(directory.glob("shard-*.safetensors")):
        t = load_file(str(path))
        offsets = t["offsets"].tolist()
        for i, (a, b) in enumerate(zip(offsets, offsets[1:])):
            # an example has one feature fewer than tokens: the i examples before hold i fewer
            yield Example(index=int(t["index"][i]), tokens=t["tokens"][a:b].long(),
                          features=t["features"][a - i : b - i - 1],
                          start=int(t["starts"][i]))
