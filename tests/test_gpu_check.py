"""The GPU check (``make gpu-check``, docs/gpu.md) runs whole on a CPU, so that it does not rot before a GPU runs it."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from evaluation.gpu_check import DEVICE_TESTS, STEPS, run_step, summary
from methods.paths import PROJECT_ROOT

MARKED = re.compile(r"^(\s*@pytest\.mark\.device\b|pytestmark = pytest\.mark\.device\b)", re.MULTILINE)


def test_the_check_runs_every_file_of_device_tests():
    marked = sorted(str(p.relative_to(PROJECT_ROOT)) for p in (PROJECT_ROOT / "tests").glob("test_*.py")
                    if MARKED.search(p.read_text(encoding="utf-8")))
    assert marked == sorted(DEVICE_TESTS), "evaluation.gpu_check.DEVICE_TESTS must list every file of device tests"


def test_a_step_that_breaks_is_recorded_and_the_check_goes_on():
    def broken():
        raise ValueError("no such thing")

    step = run_step("costs", broken)
    assert step["status"] == "error" and step["verdict"] == "ValueError: no such thing"
    assert "no such thing" in step["error"] and step["data"] == {}


@pytest.mark.slow
def test_the_check_passes_on_a_cpu(tmp_path):
    command = [sys.executable, "-m", "evaluation.gpu_check", "--device", "cpu", "--out", str(tmp_path),
               "--threads", "1", "--budget-s", "5"]
    proc = subprocess.run(command, cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=900)
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    steps = result["steps"]
    assert list(steps) == list(STEPS)
    for name in ("lossless", "host_syncs", "end_to_end"):
        assert steps[name]["status"] == "pass", (name, steps[name]["verdict"], steps[name]["error"])
    assert steps["lossless"]["data"]["tests"]["passed"] > 50 and steps["lossless"]["data"]["agreement"]
    assert steps["costs"]["status"] == "reported" and steps["costs"]["error"] is None  # a CPU: no target
    assert proc.returncode == 0, proc.stderr[-2000:]
    written = (tmp_path / "summary.md").read_text()
    assert all(title in written for title in STEPS.values()) and written == summary(result)

    # the summary's parts that only a GPU fills in render too
    result["device"], steps["versions"]["data"]["torch_cuda"] = "cuda", "12.8"
    for row in steps["host_syncs"]["data"]["methods"]:
        row |= {"device": row["steps"], "device_per_step": 1.0, "device_within_pinned": True}
    steps["costs"]["data"]["peak_memory"] = {"context": 2048, "prompt": 1966, "steps": 1, "peak_gib": 14.5,
                                             "weights_gib": 12.6}
    gpu = summary(result)
    assert "(CUDA 12.8)" in gpu and "device's own per step" in gpu and "Peak memory: 14.50 GiB" in gpu
