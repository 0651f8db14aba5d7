"""Jobs that run at the same time on one file system (a sweep on a cluster, two test workers) do not
corrupt each other's model cache or result files."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from evaluation.results import ResultFile, ResultLocked
from helpers import PROJECT_ROOT

# Converts into ``target`` through models.build_once when the test says go, slowly, so that both processes
# are inside build_once at the same time; logs who converted.
CONVERT = """
import os, sys, time
from pathlib import Path
from evaluation.models import build_once

target, log, start = map(Path, sys.argv[1:])
(start.parent / f"ready-{os.getpid()}").touch()

def convert(out):
    with open(log, "a") as f:
        f.write(f"{os.getpid()}\\n")
    out.mkdir()
    for i in range(5):
        (out / f"shard{i}").write_text(str(i) * 1000)
        time.sleep(0.2)

while not start.exists():
    time.sleep(0.01)
print(sorted(p.name for p in build_once(target, convert).iterdir()))
"""


def test_two_processes_converting_the_same_model_convert_once(tmp_path):
    target, log, start = tmp_path / "cache" / "model-1234", tmp_path / "converted.log", tmp_path / "start"
    procs = [subprocess.Popen([sys.executable, "-c", CONVERT, str(target), str(log), str(start)], cwd=PROJECT_ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    while len(list(tmp_path.glob("ready-*"))) < 2 and all(p.poll() is None for p in procs):  # both imported
        time.sleep(0.01)
    start.touch()
    outputs = [proc.communicate() for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], [err for _, err in outputs]
    shards = str([f"shard{i}" for i in range(5)])
    assert [out.strip() for out, _ in outputs] == [shards, shards]  # both see the whole conversion
    assert len(log.read_text().split()) == 1  # converted once, the other process waited for it
    assert [p.name for p in target.parent.iterdir() if not p.name.endswith(".lock")] == [target.name]  # no leftovers


def test_a_failed_conversion_leaves_nothing_half_written(tmp_path):
    from evaluation.models import build_once

    def broken(out: Path) -> None:
        out.mkdir()
        (out / "half").write_text("x")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        build_once(tmp_path / "model", broken)
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == []


def test_a_result_file_has_one_writer_at_a_time(tmp_path):
    path = tmp_path / "baseline-float32-cpu-run0.jsonl"
    with ResultFile(path, {"model": "m"}) as first:
        first.append({"question_id": 1})
        with pytest.raises(ResultLocked, match="being written by another job.*run.id"):
            ResultFile(path, {"model": "m"})
    with ResultFile(path, {"model": "m"}) as again:  # released on close: the next job resumes
        assert again.done == {1}
