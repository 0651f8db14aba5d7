"""Which jobs of a results folder are done, partial, failed or missing, and the commands that finish the rest.

    python -m evaluation.status results/readme_cpu            # a sweep (make bench EXPERIMENT=readme_cpu)
    python -m evaluation.status results/smollm2-135m/spec_bench_mini   # an interleaved or sequential run

A job is one result file: one method (label) and run id on one model and question set, under one run.dir.
The jobs expected under a folder are
- every job of every sweep (``-m``) whose run.dir is in it: each sweep writes its jobs, as Hydra's basic sweeper
  expands them, to ``<run.dir>/.multirun/<time>/sweep.json`` before the first starts (:class:`SweepManifest`);
- every job that left a run header (``*.meta.json``) or a failure marker (``*.failed.json``) there, and the
  methods an interleaved run's headers name (``interleaved_with``).
Its state: **failed** where a failure marker is beside its file (a later start of the job removes it),
else **done** when its records cover every question of its header's ``question_ids`` (an error record counts
as answered, with an error), **partial** when they cover fewer, **missing** when it left nothing.

The commands rerun exactly the jobs that are not done: a sweep's as multiruns over those jobs (one per box of
the sweep's grid that they fill), the others as the command recorded in their header or marker; rerunning a
job resumes it after its last complete record.
"""

from __future__ import annotations

import argparse
import itertools
import json
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from methods.paths import resolve_path
from evaluation.results import read_records

MANIFEST = "sweep.json"
STATES = ("done", "partial", "failed", "missing")


@dataclass
class Job:
    """One expected result file and what is known of it."""

    run_dir: Path
    model: str
    data: str
    label: str
    run: int
    path: Path | None = None  # the result file, where one exists
    recorded: int = 0  # questions of question_ids with a record (an error record included)
    errors: int = 0  # ... of which error records
    total: int | None = None  # len(question_ids) of its header
    error: str | None = None  # the first line of its failure marker's error
    command: list[str] | None = None  # what reruns it alone (header or marker)
    sweep: tuple[Path, tuple[str, ...]] | None = None  # (its sweep's manifest, its overrides there)
    swept: str = ""  # its values of the keys its sweep varies (what tells it from the sweep's other jobs)
    interleaved_with: list[str] = field(default_factory=list)

    @property
    def key(self) -> tuple:
        return (self.run_dir, self.model, self.data, self.label, self.run)

    @property
    def state(self) -> str:
        if self.error is not None:
            return "failed"
        if self.total is None:
            return "missing"
        return "done" if self.recorded >= self.total else "partial"

    @property
    def name(self) -> str:
        return f"{self.label} run{self.run}"

    def describe(self) -> str:
        """What the state line says beside the job's name."""
        count = "" if self.total is None else f"{self.recorded} of {self.total} questions"
        if self.errors:
            count += f" ({self.errors} answered with an error)"
        if self.state == "failed":
            return f"{self.error}" + (f" [{count}]" if count else "")
        if self.state == "missing":
            return "no result file" + (f" ({self.swept})" if self.swept else "")
        return count


def _job_from(meta: dict, path: Path) -> Job:
    return Job(run_dir=path.parents[2].resolve(), model=str(meta["model"]), data=str(meta["data"]),
               label=str(meta["label"]), run=int(meta["run"]))


def _read_json(path: Path) -> dict | None:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def survey(root: Path) -> list[Job]:
    """Every job expected under ``root`` (see the module docstring), in a stable order."""
    jobs: dict[tuple, Job] = {}

    def job(found: Job) -> Job:
        return jobs.setdefault(found.key, found)

    for meta_file in sorted(root.rglob("*.meta.json")):
        meta = _read_json(meta_file)
        if not meta or not {"model", "data", "label", "run", "question_ids"} <= set(meta):
            continue  # not a run header (e.g. another tool's sidecar)
        path = meta_file.with_name(meta_file.name.removesuffix(".meta.json") + ".jsonl")
        j = job(_job_from(meta, path))
        ids = set(meta["question_ids"])
        records = read_records(path)[0] if path.exists() else []
        answered = {r.get("question_id"): r for r in records if r.get("question_id") in ids}
        j.path, j.total, j.recorded = path, len(ids), len(answered)
        j.errors = sum("error" in r for r in answered.values())
        j.command = meta.get("command") or j.command
        j.interleaved_with = list(meta.get("interleaved_with", []))
    for marker_file in sorted(root.rglob("*.failed.json")):
        marker = _read_json(marker_file)
        if not marker or "error" not in marker:
            continue
        j = job(_job_from(marker, marker_file))
        error = marker["error"]
        j.error = f"{error.get('type', 'Error')}: {str(error.get('message', '')).strip()}".splitlines()[0]
        j.command = j.command or marker.get("command")
    for j in list(jobs.values()):  # the methods an interleaved run answers together
        for label in j.interleaved_with:
            sibling = job(Job(j.run_dir, j.model, j.data, label, j.run))
            sibling.command = sibling.command or j.command
    for manifest_file in sorted(root.rglob(MANIFEST)):
        manifest = _read_json(manifest_file) if manifest_file.parent.parent.name == ".multirun" else None
        entries = (manifest or {}).get("jobs", [])
        values: dict[str, set[str]] = {}
        for o in (o for entry in entries for o in entry["overrides"]):
            values.setdefault(o.split("=", 1)[0], set()).add(o)
        for entry in entries:
            j = job(Job(Path(entry["run_dir"]).resolve(), entry["model"], entry["data"], entry["label"], entry["run"]))
            j.sweep = (manifest_file, tuple(entry["overrides"]))  # the latest sweep that names the job
            j.swept = " ".join(o for o in entry["overrides"] if len(values[o.split("=", 1)[0]]) > 1)
    return sorted(jobs.values(), key=lambda j: (str(j.run_dir), j.model, j.data, j.label, j.run))


def _shown(path: Path) -> str:
    """``path`` relative to the current folder where it lies under it."""
    return str(path.relative_to(Path.cwd())) if path.is_relative_to(Path.cwd()) else str(path)


def _boxes(rows: list[tuple[tuple[str, str], ...]]) -> list[list[tuple[str, list[str]]]]:
    """Cover a set of grid points exactly with boxes (products of values per key): two boxes that differ in
    one key's values only are merged until none do."""
    boxes = [[(key, [value]) for key, value in row] for row in rows]
    merged = True
    while merged:
        merged = False
        for a, b in itertools.combinations(range(len(boxes)), 2):
            differ = [i for i, (x, y) in enumerate(zip(boxes[a], boxes[b])) if x != y]
            if len(differ) == 1:
                i = differ[0]
                key, values = boxes[a][i]
                boxes[a][i] = (key, [*values, *(v for v in boxes[b][i][1] if v not in values)])
                del boxes[b]
                merged = True
                break
    return boxes


def rerun_commands(jobs: Sequence[Job]) -> list[str]:
    """Shell commands that rerun (resume) exactly the jobs given; a note for a job with no known command."""
    commands: list[str] = []
    by_sweep: dict[Path, list[Job]] = {}
    for j in jobs:
        if j.sweep:
            by_sweep.setdefault(j.sweep[0], []).append(j)
        elif j.command:
            if shlex.join(j.command) not in commands:
                commands.append(shlex.join(j.command))
        else:
            commands.append(f"# {j.name} under {_shown(j.run_dir)}: no command recorded; "
                            "rerun the command that made it")
    for manifest_file, members in by_sweep.items():
        manifest = json.loads(manifest_file.read_text(encoding="utf-8"))
        order = [tuple(entry["overrides"]) for entry in manifest["jobs"]]  # values in the sweep's own order
        members.sort(key=lambda j: order.index(j.sweep[1]))
        rows = [tuple(tuple(o.split("=", 1)) for o in j.sweep[1]) for j in members]
        for box in _boxes(rows):
            overrides = [f"{key}={','.join(values)}" for key, values in box]
            commands.append(shlex.join([*manifest["command"], *manifest["hydra_overrides"], *overrides]))
    return commands


def report(jobs: Sequence[Job]) -> str:
    """One line per job (grouped by run.dir / model / data), the counts, and the commands for the unfinished."""
    lines = []
    for (run_dir, model, data), group in itertools.groupby(jobs, key=lambda j: j.key[:3]):
        lines.append(f"{_shown(run_dir)}/{model}/{data}:")
        group = list(group)
        width = max(len(j.name) for j in group)
        lines += [f"  {j.state:<8} {j.name:<{width}}  {j.describe()}".rstrip() for j in group]
    counts = {s: sum(j.state == s for j in jobs) for s in STATES}
    lines.append(", ".join(f"{n} {s}" for s, n in counts.items() if n) + f" of {len(jobs)} jobs")
    unfinished = [j for j in jobs if j.state != "done"]
    if unfinished:
        lines.append(f"to resume or rerun the {len(unfinished)} not done "
                     "(each resumes after its last complete record):")
        lines += [f"  {c}" for c in rerun_commands(unfinished)]
    return "\n".join(lines)


def not_done(folders: Sequence[Path]) -> list[str]:
    """The jobs under ``folders`` that are not done, one line each after a heading (empty when all are):
    what the speedup table names under it."""
    jobs = {j.key: j for folder in folders for j in survey(Path(folder)) if j.state != "done"}
    if not jobs:
        return []
    width = max(len(j.name) for j in jobs.values())
    return [f"jobs not done (python -m evaluation.status {' '.join(map(str, folders))} prints the commands that "
            "finish them):", *(f"  {j.state:<8} {j.name:<{width}}  {j.describe()}".rstrip() for j in jobs.values())]


class SweepManifest(Callback):
    """Writes every job of a sweep (``-m``) to ``<run.dir>/.multirun/<time>/sweep.json`` before any starts, so that
    ``evaluation.status`` knows the jobs that never left a file and the command that reruns a subset of them."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        from hydra import compose
        from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
        from hydra.core.override_parser.overrides_parser import OverridesParser

        from evaluation.run import run_label

        if config.hydra.job.config_name != "config" or not str(config.hydra.sweeper.get("_target_")).endswith(
                "BasicSweeper"):
            return  # evaluation.run's sweeps, expanded by Hydra's basic sweeper
        params = [f"{k}={v}" for k, v in (config.hydra.sweeper.get("params") or {}).items()]
        try:
            parsed = OverridesParser.create().parse_overrides([*params, *config.hydra.overrides.task])
            grid = [job for batch in BasicSweeper.split_arguments(parsed, None) for job in batch]
            composed = [compose(config.hydra.job.config_name, overrides=job) for job in grid]
        except Exception:  # noqa: BLE001 -- a sweep Hydra refuses: Hydra says why, before any job starts
            return
        by_dir: dict[Path, list[dict]] = {}
        for overrides, cfg in zip(grid, composed):
            run_dir = resolve_path(cfg.run.dir).resolve()
            by_dir.setdefault(run_dir, []).append({
                "overrides": list(overrides), "run_dir": str(run_dir), "model": cfg.model.name,
                "data": cfg.data.name, "label": run_label(cfg), "run": cfg.run.id})
        launcher = [o for o in config.hydra.overrides.hydra if not o.startswith("hydra.mode=")]  # -m says it
        for run_dir, jobs in by_dir.items():
            manifest = {"created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                        "command": ["python", "-m", "evaluation.run", "-m"], "hydra_overrides": launcher, "jobs": jobs}
            path = run_dir / ".multirun" / Path(str(config.hydra.sweep.dir)).name / MANIFEST
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(manifest, indent=1), encoding="utf-8")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m evaluation.status", description=__doc__.split("\n\n")[0],
                                     epilog=__doc__.split("\n\n", 2)[2],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", type=Path,
                        help="a sweep's run.dir, or any folder of result files (searched recursively)")
    args = parser.parse_args(argv)
    jobs: list[Job] = []
    for folder in args.run_dirs:
        folder = resolve_path(folder)
        if not folder.is_dir():
            print(f"status: error: {folder}: no such folder", file=sys.stderr)
            return 2
        jobs += [j for j in survey(folder) if j.key not in {k.key for k in jobs}]
    if not jobs:
        print(f"status: no jobs under {', '.join(map(str, args.run_dirs))} (no run header, failure marker or sweep)",
              file=sys.stderr)
        return 2
    print(report(jobs))
    return 0 if all(j.state == "done" for j in jobs) else 1


if __name__ == "__main__":
    sys.exit(main())
