"""Train an EAGLE-1 head for a target, self-distilled, on this machine: ``python -m evaluation.train_eagle``.

It sits beside the evaluation code because it runs the target through the harness's model loading and question
sets; the head, its data pass and its prompts are in :mod:`methods.eagle`.

Stages, each resumable (rerun the same command after an interruption):

1. prompts (:mod:`methods.eagle.prompts`), minus any that share a run of words with an evaluation set;
2. data (:mod:`methods.eagle.data`): the target's greedy answers and its features, in shards;
3. training: EAGLE-1's loss (SmoothL1 on the predicted next feature + ``p_weight`` x the soft cross-entropy
   of its next-token distribution against the target's), uniform feature noise, AdamW with warmup and
   cosine decay; a checkpoint every ``checkpoint_steps`` and at every epoch's end, and after every epoch
   the held-out chain accuracy per depth (:func:`chain_accuracy`);
4. the head in the published EAGLE-1 layout (half precision), its metrics, and its draft vocabulary
   (``train.draft_vocab`` most frequent answer tokens; the drafter's ``method.draft_vocab`` uses it).

Deterministic given ``seed`` (prompts, split, batches, noise and initialisation all follow it).
"""

from __future__ import annotations

import json
import math
import random
import sys
import time
from pathlib import Path

import hydra
import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm
from transformers import DynamicCache

from evaluation import models
from evaluation.data import DataError, humaneval_questions, read_questions
from methods.eagle.data import Example, generate_batch, read_shards, write_shard
from methods.eagle.head import EagleHead
from methods.eagle.prompts import drop_overlap, training_prompts
from methods.paths import resolve_path


def _log(message: str) -> None:
    print(f"train-eagle: {message}", file=sys.stderr, flush=True)


def evaluation_texts(paths: list[str]) -> list[str]:
    """Every turn of the evaluation sets the training prompts must not overlap (``humaneval``: the package's)."""
    texts = []
    for path in paths:
        try:
            questions = humaneval_questions() if path == "humaneval" else read_questions(path)
        except DataError as err:
            _log(f"skipping the overlap check against {path}: {err}")
            continue
        texts += [turn for q in questions for turn in q["turns"]]
    return texts


def make_prompts(cfg: DictConfig, work: Path) -> list[dict]:
    path = work / "prompts.json"
    if path.is_file():
        return json.loads(path.read_text())["prompts"]
    pairs = training_prompts(cfg.seed, cfg.train.sources, cfg.train.templates)
    pairs, dropped = drop_overlap(pairs, evaluation_texts(list(cfg.train.exclude)), cfg.train.overlap_words)
    prompts = [{"source": s, "text": p} for s, p in pairs]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"dropped_for_overlap": dropped, "prompts": prompts}, indent=0))
    tmp.replace(path)
    _log(f"{len(prompts)} prompts ({dropped} dropped: they share {cfg.train.overlap_words} words in a row "
         "with an evaluation question)")
    return prompts


def make_data(cfg: DictConfig, loaded: models.LoadedModel, prompts: list[dict], directory: Path) -> None:
    """The target's answers and features, ``gen_batch`` prompts of similar length per batch, a shard per batch."""
    directory.mkdir(parents=True, exist_ok=True)
    tokenized = [(i, models.prompt_ids(loaded.tokenizer, cfg.model.template, [{"role": "user", "content": p["text"]}]))
                 for i, p in enumerate(prompts)]
    tokenized = [(i, ids) for i, ids in tokenized if len(ids) <= cfg.train.max_prompt_tokens]
    tokenized.sort(key=lambda item: (len(item[1]), item[0]))
    batches = [tokenized[i : i + cfg.train.gen_batch] for i in range(0, len(tokenized), cfg.train.gen_batch)]
    pad = loaded.tokenizer.pad_token_id if loaded.tokenizer.pad_token_id is not None else min(loaded.eos_token_ids)
    todo = [b for b in range(len(batches)) if not (directory / f"shard-{b:05d}.safetensors").is_file()]
    if not todo:
        return
    for b in tqdm(todo, desc="train-eagle: answers + features", unit="batch", initial=len(batches) - len(todo),
                  total=len(batches)):
        batch = batches[b]
        results = generate_batch(loaded.model, [ids for _, ids in batch], cfg.train.max_new_tokens,
                                 loaded.eos_token_ids, pad)
        write_shard(directory / f"shard-{b:05d}.safetensors", [
            Example(index=i, tokens=torch.tensor(ids + answer), features=features, start=len(ids))
            for (i, ids), (answer, features) in zip(batch, results)])


def _additive(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(visible.shape, dtype=dtype).masked_fill_(~visible, torch.finfo(dtype).min)


def _batch(examples: list[Example], dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """Right-padded inputs for the head's training forward: next tokens [B, T], features [B, T, h], targets
    [B, T, h], the loss mask [B, T] (targets whose next token is part of the answer) and the attention mask."""
    width = max(len(e.tokens) for e in examples) - 1
    b, h = len(examples), examples[0].features.shape[-1]
    tokens = torch.zeros(b, width, dtype=torch.long)
    feats = torch.zeros(b, width, h, dtype=dtype)
    targets = torch.zeros(b, width, h, dtype=dtype)
    loss = torch.zeros(b, width, dtype=torch.bool)
    valid = torch.zeros(b, width, dtype=torch.bool)
    for row, e in enumerate(examples):
        n = len(e.tokens) - 1  # pairs (f_t, x_t+1) for t < n
        tokens[row, :n] = e.tokens[1:]
        feats[row, :n] = e.features.to(dtype)
        targets[row, : n - 1] = e.features[1:].to(dtype)
        # the target f_t+1 predicts token t+2: train where that token is an answer token
        loss[row, max(e.start - 2, 0) : n - 1] = True
        valid[row, :n] = True
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    mask = _additive(causal[None] & valid[:, None, :], dtype)[:, None]
    return tokens, feats, targets, loss, mask


def head_loss(head: EagleHead, embed: torch.nn.Module, vocab: torch.Tensor, batch: tuple, noise: float,
              p_weight: float, generator: torch.Generator | None) -> tuple[torch.Tensor, dict]:
    """EAGLE-1's loss on one batch; ``noise`` is the width of the uniform noise added to the input features.

    ``vocab`` holds the target's output-embedding rows of the draft vocabulary: the soft cross-entropy
    compares the two distributions over it (the target's renormalised), as EAGLE-3 trains on its ``d2t``."""
    tokens, feats, targets, loss_mask, mask = batch
    if noise:
        feats = feats + (torch.rand(feats.shape, generator=generator, dtype=feats.dtype) - 0.5) * noise
    positions = torch.arange(tokens.shape[1])[None].expand(tokens.shape[0], -1)
    with torch.no_grad():
        embeds = embed(tokens)
    out = head(embeds, feats, positions, mask, None)[loss_mask]
    target = targets[loss_mask]
    v_loss = F.smooth_l1_loss(out, target)
    with torch.no_grad():
        target_p = torch.softmax(F.linear(target, vocab), -1)
    logq = torch.log_softmax(F.linear(out, vocab), -1)
    p_loss = -(target_p * logq).sum(-1).mean()
    top1 = (logq.argmax(-1) == target_p.argmax(-1)).float().mean()
    return v_loss + p_weight * p_loss, {"v_loss": v_loss.item(), "p_loss": p_loss.item(), "top1": top1.item()}


@torch.no_grad()
def chain_accuracy(head: EagleHead, embed: torch.nn.Module, vocab: torch.Tensor, ids: torch.Tensor,
                   examples: list[Example], depth: int) -> list[float]:
    """Per depth d, the fraction of answer positions where the head's first d chained guesses are all right;
    a guess is the draft vocabulary's best token (``ids``: its target ids, ``vocab``: their output rows).

    As in drafting: the head's context holds entries computed from the target's features; at depth d > 1
    it is fed its own previous output (and the token, which equals its guess whenever the chain is still
    right) at the next position, seeing the context up to where the chain started and its own chain."""
    hits, total = [0] * depth, 0
    dtype = head.fc.weight.dtype
    for e in examples:
        n = len(e.tokens) - 1
        tokens, feats = e.tokens, e.features.to(dtype)
        first = max(e.start - 1, 0)  # chains from t = start - 1 guess token start + 1 onwards
        starts = torch.arange(first, n - 1)  # chain start t: its depth-d guess is token t + d + 1
        if len(starts) == 0:
            continue
        cache = DynamicCache()
        positions = torch.arange(n)[None]
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        out = head(embed(tokens[1 : n + 1])[None], feats[None], positions, _additive(causal, dtype)[None, None],
                   cache)[0][starts]
        alive = torch.ones(len(starts), dtype=torch.bool)
        m = len(starts)
        seen = causal[starts]  # [m, n]: each chain sees the context up to its start
        eye = torch.eye(m, dtype=torch.bool)
        for d in range(depth):
            target_pos = starts + d + 2  # out predicts the feature at t + d + 1, hence token t + d + 2
            ok = target_pos <= n
            guess = ids[F.linear(out, vocab).argmax(-1)]
            right = ok & (guess == tokens[target_pos.clamp(max=n)])
            alive &= right
            hits[d] += int(alive.sum())
            if d == depth - 1 or not bool(alive.any()):
                break
            fed = tokens[target_pos.clamp(max=n)]
            seen = torch.cat([seen, eye], 1)
            out = head(embed(fed)[None], out[None], (starts + d + 1)[None], _additive(seen, dtype)[None, None],
                       cache)[0]
        total += m
    return [h / max(total, 1) for h in hits]


def _batches(examples: list[Example], batch_tokens: int, rng: random.Random) -> list[list[Example]]:
    """Similar lengths together (sorted within windows of 64), at most ``batch_tokens`` padded tokens each."""
    order = examples[:]
    rng.shuffle(order)
    batches = []
    for w in range(0, len(order), 64):
        window = sorted(order[w : w + 64], key=lambda e: len(e.tokens))
        batch: list[Example] = []
        for e in window:
            if batch and (len(batch) + 1) * len(e.tokens) > batch_tokens:
                batches.append(batch)
                batch = []
            batch.append(e)
        if batch:
            batches.append(batch)
    rng.shuffle(batches)
    return batches


def train(cfg: DictConfig, loaded: models.LoadedModel, examples: list[Example], heldout: list[Example],
          ids: torch.Tensor, work: Path) -> tuple[EagleHead, dict]:
    t = cfg.train
    torch.manual_seed(cfg.seed)
    model = loaded.model
    head = EagleHead(model).float()
    for p in model.parameters():
        p.requires_grad_(False)
    embed = model.get_input_embeddings()
    vocab = model.get_output_embeddings().weight[ids].float()
    scale = torch.cat([e.features[: 64].float() for e in examples[:256]]).std().item()
    noise = t.noise * scale
    steps_per_epoch = len(_batches(examples, t.batch_tokens, random.Random(cfg.seed)))
    total = max(1, steps_per_epoch * t.epochs)
    warmup = max(1, int(t.warmup * total))
    optimizer = torch.optim.AdamW(head.parameters(), lr=t.lr, betas=(0.9, 0.95), weight_decay=t.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min((s + 1) / warmup, 0.5 * (
        1 + math.cos(math.pi * min(1.0, max(0, s - warmup) / max(1, total - warmup))))))
    metrics = {"epochs": [], "examples": len(examples), "heldout_examples": len(heldout), "draft_vocab": len(ids),
               "train_tokens": sum(len(e.tokens) - e.start for e in examples), "noise": noise}
    ckpt = work / "checkpoint.pt"
    epoch, done_in_epoch = 0, 0
    sums = {"v_loss": 0.0, "p_loss": 0.0, "top1": 0.0}  # over the epoch's batches so far
    if ckpt.is_file():
        state = torch.load(ckpt, weights_only=False)
        head.load_state_dict(state["head"])
        optimizer.load_state_dict(state["optimizer"])
        schedule.load_state_dict(state["schedule"])
        epoch, done_in_epoch, metrics, sums = state["epoch"], state["done_in_epoch"], state["metrics"], state["sums"]
        _log(f"resuming at epoch {epoch + 1}, batch {done_in_epoch}")

    def save(epoch_: int, done_: int) -> None:
        tmp = ckpt.with_name(ckpt.name + ".tmp")
        torch.save({"head": head.state_dict(), "optimizer": optimizer.state_dict(), "schedule": schedule.state_dict(),
                    "epoch": epoch_, "done_in_epoch": done_, "metrics": metrics, "sums": sums}, tmp)
        tmp.replace(ckpt)

    while epoch < t.epochs:
        batches = _batches(examples, t.batch_tokens, random.Random(cfg.seed + epoch))
        generator = torch.Generator().manual_seed(cfg.seed * 1000 + epoch)
        head.train()
        started = time.time()
        bar = tqdm(range(done_in_epoch, len(batches)), desc=f"train-eagle: epoch {epoch + 1}/{t.epochs}",
                   unit="batch", initial=done_in_epoch, total=len(batches))
        for i in bar:
            generator.manual_seed(cfg.seed * 1000 + epoch * 100_000 + i)  # the same noise after a resume
            loss, parts = head_loss(head, embed, vocab, _batch(batches[i], torch.float32), noise, t.p_weight,
                                    generator)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_value_(head.parameters(), t.grad_clip)
            optimizer.step()
            schedule.step()
            for k in sums:
                sums[k] += parts[k]
            bar.set_postfix(loss=f"{loss.item():.3f}", top1=f"{parts['top1']:.2f}")
            if (i + 1) % t.checkpoint_steps == 0:
                save(epoch, i + 1)
        head.eval()
        accuracy = chain_accuracy(head, embed, vocab, ids, heldout[: t.eval_examples], t.eval_depth)
        metrics["epochs"].append({"epoch": epoch + 1, **{k: round(v / len(batches), 4) for k, v in sums.items()},
                                  "heldout_chain_accuracy": [round(a, 4) for a in accuracy],
                                  "seconds": round(time.time() - started, 1)})
        _log(f"epoch {epoch + 1}: held-out chain accuracy by depth {[round(a, 3) for a in accuracy]}")
        epoch, done_in_epoch = epoch + 1, 0
        sums = dict.fromkeys(sums, 0.0)
        save(epoch, 0)
    return head, metrics


def draft_vocabulary(examples: list[Example], vocab_size: int, size: int | None) -> torch.Tensor:
    """The ``size`` target token ids most frequent in the answers (ties by id; all of them when None), most
    frequent first, as EAGLE-3's ``d2t`` (draft id -> target id): drafting over them costs size/V of the
    output projection, and a token outside them is one the head would rarely have been right about."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for e in examples:
        counts += torch.bincount(e.tokens[e.start :], minlength=vocab_size)
    return torch.sort(-counts, stable=True).indices[: size or vocab_size]


def run(cfg: DictConfig) -> Path:
    if cfg.threads:
        torch.set_num_threads(int(cfg.threads))
    torch.manual_seed(cfg.seed)
    t = cfg.train
    work = resolve_path(t.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    device = models.resolve_device(cfg.device)
    loaded = models.load(cfg.model, device, torch.float32)
    prompts = make_prompts(cfg, work)
    started = time.time()
    make_data(cfg, loaded, prompts, work / "data")
    examples = list(read_shards(work / "data"))
    heldout = [e for e in examples if e.index % t.heldout_every == 0]
    examples = [e for e in examples if e.index % t.heldout_every != 0]
    _log(f"{len(examples)} training and {len(heldout)} held-out conversations, "
         f"{sum(len(e.tokens) - e.start for e in examples)} answer tokens to learn from "
         f"({time.time() - started:.0f} s for the data)")
    if t.epochs == 0:
        return work
    output = loaded.model.get_output_embeddings().weight.detach()
    ids = draft_vocabulary(examples, output.shape[0], t.draft_vocab)
    head, metrics = train(cfg, loaded, examples, heldout, ids, work)
    # the head ships in half precision: its held-out accuracy there, beside the float32 figure
    embed, vocab = loaded.model.get_input_embeddings(), output[ids].float()
    rounded = EagleHead(loaded.model).float()
    rounded.load_state_dict({k: v.half().float() for k, v in head.state_dict().items()})
    metrics["heldout_chain_accuracy_float16_weights"] = [
        round(a, 4) for a in chain_accuracy(rounded.eval(), embed, vocab, ids, heldout[: t.eval_examples],
                                            t.eval_depth)]
    counts: dict[str, int] = {}
    for p in prompts:
        counts[p["source"]] = counts.get(p["source"], 0) + 1
    metrics.update({"sources": counts, "seed": cfg.seed, "config": OmegaConf.to_container(t, resolve=True),
                    "target": cfg.model.name, "head_params": sum(p.numel() for p in head.parameters())})
    out = resolve_path(t.out)
    head.half().save(out, metrics, ids if len(ids) < output.shape[0] else None)
    _log(f"wrote {out} (held-out chain accuracy by depth: {metrics['epochs'][-1]['heldout_chain_accuracy']})")
    return out


@hydra.main(version_base=None, config_path="../conf", config_name="train_eagle")
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    main()
