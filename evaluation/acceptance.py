"""Acceptance statistics of a drafter's wide candidate tree: what ``method.tree=auto`` chooses from.

    python -m evaluation.acceptance method=recycling method.tree=paper-b4 data=spec_bench_mini max_new_tokens=128

Runs the method through ``evaluation.run`` on a calibration question set (durable and resumable like
every run, under ``<autotree.dir>/runs``) and counts, for every node of its wide candidate tree
(``Drafter.candidate_tree``: Token Recycling's and EAGLE's ``conf/trees/wide.yaml``, 142 nodes; PLD's chain
of 16), by rank path, the share of drafting steps in which it was, or would have been, accepted. PLD and
EAGLE verify the candidate tree itself: what they draft depends only on the context, which greedy
decoding fixes.
Token Recycling's matrix learns from the positions it verifies, so a 142-node run would overstate
what a small tree accepts: it verifies ``method.tree`` (``auto``: the plan made from earlier
statistics, so a second pass converges on the tree it measures) and scores the candidate tree in its
shadow (:class:`~methods.tree_search.ShadowTree`). Collect
them on questions you do not evaluate: ``method.tree=auto`` refuses statistics whose questions overlap
the evaluated ones. The file is keyed by model, dtype and the method's other settings (verification is
exact, so acceptance is a property of the model and the drafter, not of the hardware), and under sampling by
the sampling settings: acceptance depends on the temperature (``sampling.temperature=1`` collects them for it).

A drafter with a per-step policy (SAM's ``mode=auto``) also gets per-class statistics (``policy-*.json``,
:func:`collect_policy`): at every step it scores its candidate chain and its auxiliary's draft against the
true continuation, by match length.
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Iterable

import hydra
from omegaconf import DictConfig, OmegaConf, open_dict

from evaluation import data as datasets
from evaluation import models
from evaluation.results import ResumeRefused
from evaluation.run import run
from evaluation.store import (AcceptanceError, StoreError, drafter_class, find_calibration, first_verified, policy_key,
                              question_hashes, reusable_statistics, sampling_key, statistics_key, statistics_method,
                              statistics_paths, tunable)
from methods.paths import PROJECT_ROOT, resolve_path


def count(records: Iterable[dict]) -> tuple[Counter, int, int]:
    """Accepted-node counts by rank path, decode steps, and steps that drafted at least one node.

    From the shadow tree's counters where the drafter scored one (``drafter_stats``), else from the
    verified steps' accepted paths.
    """
    nodes: Counter = Counter()
    steps = drafting = 0
    for record in records:
        choice = record.get("choices", [{}])[0]
        shadows = [s for s in choice.get("drafter_stats", []) if "shadow_steps" in s]
        for shadow in shadows:
            steps += shadow["shadow_steps"]
            drafting += shadow["shadow_steps"]
            nodes.update({tuple(map(int, name.split("."))): n for name, n in shadow["shadow_accepted"].items()})
        if shadows:
            continue
        for path, size in zip(choice.get("accept_paths", []), choice.get("block_sizes", [])):
            steps += 1
            drafting += size > 1
            nodes.update(tuple(path[: d + 1]) for d in range(len(path)))
    return nodes, steps, drafting


def count_policy(records: Iterable[dict]) -> tuple[dict[int, Counter], int]:
    """Steps by class and (chain depth, aux depth), pooled over turns, and the number of steps."""
    counts: dict[int, Counter] = {}
    steps = 0
    for record in records:
        for facts in record.get("choices", [{}])[0].get("drafter_stats", []):
            for name, n in facts.get("policy_shadow", {}).items():
                m, c, a = map(int, name.split(":"))
                counts.setdefault(m, Counter())[c, a] += n
                steps += n
    return counts, steps


def collect(cfg: DictConfig) -> Path:
    """Collect the statistics on ``cfg.data`` and write their file.

    A drafter scored in a shadow runs ``autotree.passes`` times: the first verifies ``method.<tree>``
    (``auto``: the method's default in ``conf/method/``), every later pass the plan made from the statistics
    before it, so the tree measured is (close to) the tree chosen.
    """
    method = statistics_method(cfg.method)
    if method is not cfg.method:
        print(f"acceptance: method {cfg.method.name} drafts its tree with {method.name}: collecting {method.name}'s "
              "statistics", file=sys.stderr)
        cfg = cfg.copy()
        with open_dict(cfg):
            cfg.method = method
    cls, param = tunable(cfg.method)
    candidate = cfg.autotree.candidate or cls.candidate_tree
    done = reusable_statistics(cfg, policy=False, expected={"candidate": {param: candidate}})
    if done:
        return done
    passes = cfg.autotree.passes if cls.shadow_param else 1
    print(f"acceptance: collecting {cfg.method.name}'s statistics on {cfg.data.name}, {estimate(cfg, passes)}",
          file=sys.stderr)
    path = _collect(cfg, cls, param, candidate, first_verified(cfg.method, param, cls.statistics_tree))
    for _ in range(passes - 1):
        path = _collect(cfg, cls, param, candidate, "auto")
    return path


def _run(cfg: DictConfig) -> Path:
    """A statistics run through the harness's own loop, so the statistics come from a real run. An interrupted one
    resumes; one left by other settings or code (a new calibration, a new commit) is started anew, its old file
    kept as a .bak: statistics are collected anew only when they are to be remade."""
    try:
        return run(cfg)
    except ResumeRefused as err:
        print(f"acceptance: starting the statistics run anew: {err}", file=sys.stderr)
        with open_dict(cfg):
            cfg.run.resume = False
        return run(cfg)


def _collect(cfg: DictConfig, cls: type, param: str, candidate: object, verified: object) -> Path:
    run_cfg = cfg.copy()
    with open_dict(run_cfg):
        if cls.shadow_param:  # verify `verified` (auto: the current plan) and score the candidate in its shadow
            run_cfg.method[param] = verified
            run_cfg.method[cls.shadow_param] = candidate
            run_cfg.autotree.allow_overlap = True  # the plan verified with is not being evaluated here
            run_cfg.autotree.online = False  # statistics of the plan as chosen, not of a run that corrects it
        else:
            run_cfg.method[param] = candidate
        run_cfg.run.dir = str(Path(cfg.autotree.dir) / "runs")
        run_cfg.batch_size = 1  # statistics of one sequence at a time, whatever batch size they serve (online plans
        # correct the acceptance of a batch's shared state as they run)
    result = _run(run_cfg)
    meta = json.loads(result.with_name(result.name.removesuffix(".jsonl") + ".meta.json").read_text())
    records = [json.loads(line) for line in result.read_text().splitlines() if line.strip()]
    nodes, steps, drafting = count(records)
    if not drafting:
        raise AcceptanceError(f"{result}: no step drafted anything; nothing to learn a tree from")
    questions = datasets.load(cfg.data)
    path = statistics_paths(resolve_path(cfg.autotree.dir), cfg.model.name, meta["dtype"], cfg.method, cfg.data.name,
                            sampled=sampling_key(cfg))[0]
    body = {
        "key": statistics_key(cfg, cfg.method, meta["dtype"]),
        "candidate": {param: candidate},
        "scored": f"in the shadow of method.{param}={run_cfg.method[param]}" if cls.shadow_param else "verified",
        "steps": steps, "drafting_steps": drafting, "draft_rate": drafting / steps,
        "nodes": [{"path": list(p), "p": n / drafting} for p, n in sorted(nodes.items(), key=lambda x: (len(x[0]), x[0]))],
        "question_hashes": question_hashes(questions),
        "provenance": {"data": cfg.data.name, "question_ids": meta["question_ids"],
                       "max_new_tokens": cfg.max_new_tokens, "result_file": str(result),
                       "git_commit": meta.get("git_commit"), "device_name": meta.get("device_name"),
                       "mat": sum(sum(r["choices"][0]["accept_lengths"]) for r in records if "choices" in r) / steps},
    }
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(body, indent=1))
    tmp.replace(path)
    print(f"acceptance: {drafting} drafting steps of {steps}, {len(nodes)} nodes ever accepted -> {path}", file=sys.stderr)
    return path


def collect_policy(cfg: DictConfig) -> Path:
    """Collect a drafter's per-class statistics (``method.mode=auto``) on ``cfg.data`` and write their file.

    The first pass verifies ``method.<policy>`` as configured (``auto``: the method's default in
    ``conf/method/``), every later pass the plan made from the pass before; every pass scores the drafter's
    candidate chain and its auxiliary's draft at every step.
    """
    cls = drafter_class(cfg.method)
    policy_key(cfg.method)  # a method without a policy is refused here
    done = reusable_statistics(cfg, policy=True, expected={"score": cls.candidate_score})
    if done:
        return done
    print(f"acceptance: collecting {cfg.method.name}'s per-class statistics on {cfg.data.name}, "
          f"{estimate(cfg, cfg.autotree.passes)}", file=sys.stderr)
    path = _collect_policy(cfg, cls, first_verified(cfg.method, cls.policy_param))
    for _ in range(cfg.autotree.passes - 1):
        path = _collect_policy(cfg, cls, "auto")
    return path


def _collect_policy(cfg: DictConfig, cls: type, verified: object) -> Path:
    run_cfg = cfg.copy()
    with open_dict(run_cfg):
        run_cfg.method[cls.policy_param] = verified
        run_cfg.method[cls.score_param] = cls.candidate_score
        run_cfg.autotree.allow_overlap = True  # the plan verified with is not being evaluated here
        run_cfg.autotree.online = False
        run_cfg.run.dir = str(Path(cfg.autotree.dir) / "runs" / f"{cls.score_param}{cls.candidate_score}")
        run_cfg.batch_size = 1  # as _collect
    result = _run(run_cfg)
    meta = json.loads(result.with_name(result.name.removesuffix(".jsonl") + ".meta.json").read_text())
    records = [json.loads(line) for line in result.read_text().splitlines() if line.strip()]
    counts, steps = count_policy(records)
    if not steps:
        raise AcceptanceError(f"{result}: no step was scored; nothing to choose a policy from")
    path = statistics_paths(resolve_path(cfg.autotree.dir), cfg.model.name, meta["dtype"], cfg.method, cfg.data.name,
                            policy=True, sampled=sampling_key(cfg))[0]
    body = {
        "key": statistics_key(cfg, cfg.method, meta["dtype"], policy=True),
        "score": cls.candidate_score, "scored": f"in the shadow of method.{cls.policy_param}={verified}",
        "steps": steps,
        "classes": {str(m): {f"{c}:{a}": n for (c, a), n in sorted(table.items())} for m, table in sorted(counts.items())},
        "question_hashes": question_hashes(datasets.load(cfg.data)),
        "provenance": {"data": cfg.data.name, "question_ids": meta["question_ids"], "max_new_tokens": cfg.max_new_tokens,
                       "result_file": str(result), "git_commit": meta.get("git_commit"),
                       "device_name": meta.get("device_name")},
    }
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(body, indent=1))
    tmp.replace(path)
    print(f"acceptance: {steps} steps scored by match length -> {path}", file=sys.stderr)
    return path


def heldout(cfg: DictConfig) -> DictConfig:
    """``cfg`` with its data replaced by ``autotree.heldout`` questions per group that it does not evaluate
    (:func:`evaluation.data.heldout`: the same categories, from ``data.heldout_from`` where the evaluated set is a
    file of its own), written to a question file under ``autotree.dir`` so that the statistics run is a plain run;
    ``autotree.heldout=0``: ``cfg`` as it is (the data given are the statistics' own)."""
    per_group = cfg.autotree.heldout
    if not per_group:
        return cfg
    source = None
    if cfg.data.get("heldout_from"):
        source = OmegaConf.load(PROJECT_ROOT / "conf" / "data" / f"{cfg.data.heldout_from}.yaml")
        OmegaConf.resolve(source)
    questions = datasets.heldout(cfg.data, per_group, source)
    digest = hashlib.sha1(json.dumps(question_hashes(questions)).encode()).hexdigest()[:8]
    name = f"{cfg.data.name}-heldout{per_group}"
    path = resolve_path(cfg.autotree.dir) / "heldout" / f"{name}-{digest}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(q, ensure_ascii=False) + "\n" for q in questions))
    out = cfg.copy()
    with open_dict(out):
        out.data = {"name": name, "format": "jsonl", "path": str(path), "ids": None, "categories": None,
                    "per_category": None, "limit": None}
    ids = ", ".join(str(q["question_id"]) for q in questions)
    print(f"acceptance: statistics on {len(questions)} questions not evaluated ({per_group} per group of the evaluated "
          f"categories, from {source.path if source else cfg.data.path}): {ids}", file=sys.stderr)
    return out


def estimate(cfg: DictConfig, passes: int) -> str:
    """About how long collecting will take on this machine: every turn's token budget at the single-token step
    time its calibration predicts at that turn's context (an upper bound where answers end early or drafts pay)."""
    try:
        device = models.resolve_device(cfg.device)
        calibration, _ = find_calibration(cfg, device, models.resolve_dtype(cfg.dtype, device, cfg.model))
    except StoreError:
        return "its time unknown (no calibration of this machine)"
    tokenizer = models.load_tokenizer(cfg.model)
    seconds, turns = 0.0, 0
    for q in datasets.load(cfg.data):
        for i, turn in enumerate(q["turns"]):
            prompt = len(models.prompt_ids(tokenizer, cfg.model.template, [{"role": "user", "content": turn}]))
            context = prompt + i * cfg.max_new_tokens  # a later turn's prompt holds the earlier answers
            seconds += cfg.max_new_tokens * calibration.seconds(1, context + cfg.max_new_tokens // 2)
            turns += 1
    return f"about {passes * seconds / 60:.1f} min ({passes} pass{'es' if passes > 1 else ''} over {turns} turns)"


@hydra.main(version_base=None, config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    """Statistics for every ``auto`` of the method: its tree's (or its tree owner's), and its policy's."""
    try:
        cfg = heldout(cfg)
        collect(cfg)
        if drafter_class(cfg.method).policy_param:
            collect_policy(cfg)
    except (StoreError, datasets.DataError) as err:
        sys.exit(f"acceptance: error: {err}")


if __name__ == "__main__":
    main()
