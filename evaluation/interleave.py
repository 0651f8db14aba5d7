"""Run several methods on one question set in turn: question 1 by every method, then question 2, ...

    python -m evaluation.interleave 'methods=[baseline,"recycling:tree=auto",pld,"sam:mode=auto,aux_tree=auto"]' \\
        data=spec_bench data.per_category=10 max_new_tokens=128 threads=2

Run one after another, methods are timed at different hours, and this machine's speed drifts within
a run (a baseline at the end of an 80-minute run measured 1.17x the one at its start): a method's
speedup then depends on when it ran. Answered in turn, every method sees the same drift. The order
rotates with the question (question i starts with method i mod n), so no method always follows the
same one. One model is loaded and shared; each method keeps its own drafter, hot-start state and
result file, the same file ``python -m evaluation.run`` writes (its header adds ``interleaved_with``),
so the analysis reads them alike, and rerunning the same command resumes every method where it stopped.

With ``batch_size=B`` > 1 every method serves its questions B at a time with its own batched engine (continuous
batching, docs/batching.md), and the turn is a step: each method makes one batched step in turn, the order
rotating every round. A batched engine's clock counts its own work only (its prefills and steps), so each method's
times are what it would take alone, and a drift in the machine's speed hits every method alike, step by step.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path

import hydra
from hydra import compose
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig
from tqdm import tqdm

from evaluation import data as datasets
from evaluation import signals
from evaluation.results import ResultLocked
from evaluation.run import Job, fail, record_failure, run_label
from evaluation.signals import Stopped


class MethodsError(ValueError):
    """The ``methods`` list cannot be run together; the message says which entry and why."""


def method_overrides(entry: str) -> list[str]:
    """``NAME`` or ``NAME:key=value,key=value`` (as ``make bench`` METHODS) as Hydra overrides."""
    name, _, options = str(entry).partition(":")
    pairs = [p.strip() for p in options.split(",") if p.strip()]
    if not name.strip() or any("=" not in p for p in pairs):
        raise MethodsError(f"methods entry {entry!r}: write NAME or NAME:key=value,key=value (e.g. recycling:tree=auto)")
    return [f"method={name.strip()}", *(f"method.{p}" for p in pairs)]


def method_configs(methods: list[str], shared: list[str]) -> list[DictConfig]:
    """The run config of every entry of ``methods``, composed as ``evaluation.run`` would with ``shared``."""
    if not methods:
        raise MethodsError("methods is empty: name at least one, e.g. 'methods=[baseline,recycling]'")
    misplaced = [o for o in shared if o.lstrip("+~").split("=")[0].split(".")[0] == "method"]
    if misplaced:
        raise MethodsError(f"{', '.join(misplaced)}: give method settings inside the methods entries "
                           "(e.g. 'methods=[baseline,\"recycling:tree=auto\"]'), not as method=... or method.<key>=...")
    configs = [compose("config", overrides=[*shared, *method_overrides(m)]) for m in methods]
    labels = [c.method.label for c in configs]
    twice = sorted({label for label in labels if labels.count(label) > 1})
    if twice:
        raise MethodsError(f"methods {', '.join(twice)} appear twice (same label, same result file); give one of them "
                           "another label, e.g. recycling:tree=paper,label=recycling-paper")
    return configs


def interleave(configs: list[DictConfig], command: Sequence[str] = ()) -> list[Path]:
    """Answer every question with every config's method in turn; return the result files' paths.

    SIGTERM or SIGUSR2 stops it cleanly (``evaluation.signals``): the question in flight is abandoned by the
    method answering it, every file is closed whole, and rerunning resumes every method at that question.
    """
    questions = datasets.load(configs[0].data)  # the same data for every method: only method.* differ
    with signals.stop_on_signals(), ExitStack() as stack:
        jobs: list[Job] = []
        for cfg in configs:  # every method is set up (files checked, locked, warmed up) before the first question
            job = Job(cfg, questions, loaded=jobs[0].loaded if jobs else None,
                      interleaved_with=tuple(run_label(c) for c in configs if c is not cfg), command=command)
            stack.callback(job.close)
            jobs.append(job)
        if jobs[0].batch is not None:
            _in_steps(jobs, configs[0].run.progress)
            return [job.path for job in jobs]
        pending = [{q["question_id"] for q in job.todo} for job in jobs]
        progress = tqdm(questions, desc="interleaved", unit="q", disable=not configs[0].run.progress, file=sys.stderr)
        for i, question in enumerate(progress):
            for j in [*range(i % len(jobs), len(jobs)), *range(i % len(jobs))]:
                if question["question_id"] in pending[j]:
                    jobs[j].answer(question)
    return [job.path for job in jobs]


def _in_steps(jobs: list[Job], progress: bool) -> None:
    """Batched jobs: one step of each in turn, the order rotating every round, until every job has served its
    questions."""
    with tqdm(total=sum(len(job.todo) for job in jobs), desc="interleaved", unit="q", disable=not progress,
              file=sys.stderr) as bar:
        for job in jobs:
            job.on_record = lambda record: bar.update()
        serving = {j: job.serve(job.todo) for j, job in enumerate(jobs)}
        turn = 0
        while serving:
            live = list(serving)
            for j in [*live[turn % len(live):], *live[: turn % len(live)]]:
                if next(serving[j], None) is None:
                    del serving[j]
            turn += 1


@hydra.main(version_base=None, config_path="../conf", config_name="interleave")
def main(cfg: DictConfig) -> None:
    overrides = list(HydraConfig.get().overrides.task)
    shared = [o for o in overrides if o.lstrip("+~").split("=")[0] != "methods"]
    try:
        configs = method_configs(list(cfg.methods), shared)
    except MethodsError as err:  # refused before anything runs
        sys.exit(f"draftbench: error: {err}")
    command = ["python", "-m", "evaluation.interleave", *overrides]
    try:
        interleave(configs, command)
    except Stopped:  # the message is printed
        sys.exit(signals.EXIT_STOPPED)
    except Exception as err:  # noqa: BLE001 -- every method's job failed with it: each gets a marker
        markers = [] if isinstance(err, ResultLocked) else [record_failure(c, err, command) for c in configs]
        fail(err, [m for m in markers if m], cfg.run.dir)


if __name__ == "__main__":
    main()
