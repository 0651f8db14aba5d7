"""Result files: one jsonl record per question plus a ``.meta.json`` run header beside it.

Records are a superset of Spec-Bench's answer schema, so Spec-Bench's tools read them; the header
(a sidecar, so the jsonl stays Spec-Bench-readable) carries the provenance. Records are appended
one per question, flushed and fsynced: a killed run loses at most the question in flight, and the
next start drops a partial last line and resumes after the last complete record. A result file has
one writer at a time (a lock beside it), so two jobs of a sweep that name the same file cannot
interleave their records.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import time
import traceback
from importlib import metadata
from pathlib import Path
from typing import Any

import torch
from filelock import FileLock, Timeout

from evaluation import models
from methods.paths import PROJECT_ROOT

SCHEMA = 1

PACKAGES = ("torch", "transformers", "accelerate", "gguf", "hydra-core", "fschat", "draftbench")


def _git(*args: str) -> str | None:
    try:
        return subprocess.run(["git", *args], cwd=PROJECT_ROOT, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def environment(device: torch.device) -> dict:
    """Where and with what a run was made: recorded in every result header."""
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return {
        "git_commit": _git("rev-parse", "HEAD"),
        "git_dirty": bool(_git("status", "--porcelain", "--untracked-files=no")),
        "versions": versions,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": models.cpu_model(),
        "torch_threads": torch.get_num_threads(),
        "device_name": models.device_name(device),
        "masked_gqa": models.masked_gqa(device),
    }


# Header keys that may differ between the start of a run and its resumption (``command``: how it was started,
# kept from the first start; a requeued or rerun job may spell the same job differently).
RESUME_FREE = ("started", "resumed", "run_config", "command")


class ResumeRefused(RuntimeError):
    """An existing result file was written under a different configuration or provenance."""


class ResultLocked(RuntimeError):
    """Another job is writing the same result file."""


def meta_path(path: Path) -> Path:
    return path.with_name(path.name.removesuffix(".jsonl") + ".meta.json")


def failure_path(path: Path) -> Path:
    """The failure marker of the job whose result file is ``path``: ``<name>.failed.json`` beside it."""
    return path.with_name(path.name.removesuffix(".jsonl") + ".failed.json")


def write_failure(path: Path, err: BaseException, job: dict) -> Path:
    """Record that the job of result file ``path`` failed as a whole (``job``: what identifies and reruns it)."""
    lines = traceback.format_exception(err)
    marker = {"error": {"type": type(err).__name__, "message": str(err), "traceback": "".join(lines[-12:])},
              "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **job}
    path.parent.mkdir(parents=True, exist_ok=True)
    _write_json_atomic(failure_path(path), marker)
    return failure_path(path)


def _write_json_atomic(path: Path, obj: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_records(path: Path) -> tuple[list[dict], int | None]:
    """Complete records of a result file, and the byte offset of a partial last line (or None)."""
    records, offset = [], 0
    with open(path, "rb") as f:
        for line in f:
            try:
                if not line.endswith(b"\n"):
                    raise ValueError("no newline")
                records.append(json.loads(line))
            except ValueError:
                return records, offset
            offset += len(line)
    return records, None


def diff_keys(old: Any, new: Any, prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two nested dicts."""
    if isinstance(old, dict) and isinstance(new, dict):
        return [d for k in sorted(set(old) | set(new)) for d in diff_keys(old.get(k), new.get(k), f"{prefix}{k}.")]
    return [] if old == new else [prefix.rstrip(".")]


class ResultFile:
    """Appends question records to ``path``; resumes an existing file written by the same run."""

    def __init__(self, path: Path, header: dict, resume: bool = True):
        self.path, self.meta = path, meta_path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        self.records: list[dict] = []
        self.notes: list[str] = []
        self._lock = FileLock(path.with_name(path.name + ".lock"), timeout=0)
        try:
            self._lock.acquire()
        except Timeout as err:
            raise ResultLocked(
                f"{path} is being written by another job (it holds {self._lock.lock_file}); jobs that run at the "
                "same time need distinct result files: give them different run.id values or run.dir, or wait"
            ) from err
        try:
            self._open(header, resume)
        except BaseException:
            self._lock.release()
            raise

    def _open(self, header: dict, resume: bool) -> None:
        path = self.path
        if resume and path.exists() and self.meta.exists():
            self._resume(header)
        else:
            if path.exists():
                stamp = time.strftime("%Y%m%d-%H%M%S")
                for old in (path, self.meta):
                    if old.exists():
                        old.rename(old.with_name(f"{old.name}.bak-{stamp}"))
                        self.notes.append(f"moved the previous {old.name} aside to {old.name}.bak-{stamp}")
            _write_json_atomic(self.meta, {**header, "schema": SCHEMA})
            path.write_text("")
        self._file = open(path, "a", encoding="utf-8")

    def _resume(self, header: dict) -> None:
        old = json.loads(self.meta.read_text())
        if old.get("schema") != SCHEMA:
            raise ResumeRefused(
                f"{self.meta} was written by result schema {old.get('schema')}, this draftbench writes {SCHEMA}; "
                "use run.resume=false to start a new file (the old one is kept as a .bak)"
            )
        differing = [k for k in diff_keys(old, {**header, "schema": SCHEMA}) if k.split(".")[0] not in RESUME_FREE]
        if differing:
            raise ResumeRefused(
                f"{self.path} exists and was written with a different configuration or provenance "
                f"({', '.join(differing)}); rerun with the same settings to resume, or with run.resume=false "
                "to start a new file (the old one is kept as a .bak)"
            )
        self.records, partial = read_records(self.path)
        if partial is not None:
            with open(self.path, "r+b") as f:
                f.truncate(partial)
            self.notes.append(f"dropped a partial last line of {self.path.name} (an interrupted write)")
        old["resumed"] = [*old.get("resumed", []), time.strftime("%Y-%m-%dT%H:%M:%S%z")]
        _write_json_atomic(self.meta, old)
        if self.records:
            self.notes.append(f"resuming {self.path.name}: {len(self.records)} questions already done")

    @property
    def done(self) -> set:
        return {r["question_id"] for r in self.records}

    def append(self, record: dict) -> None:
        """Write one record durably (flush + fsync), so a kill never leaves a half-written answer."""
        self._file.write(json.dumps(record, ensure_ascii=False) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())
        self.records.append(record)

    def close(self) -> None:
        self._file.close()
        self._lock.release()

    def __enter__(self) -> "ResultFile":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
