"""End to end on the real embedded model (SmolLM2-135M-Instruct, float32, CPU).

The equality test is the product's promise: every method's output ids equal the baseline's on every
question of spec_bench_mini. Slow (minutes): marked, and run by `make test` and CI.
"""

from __future__ import annotations

import json
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from evaluation import equal
from evaluation.models import load_tokenizer
from evaluation.run import run
from helpers import config, method_names

pytestmark = pytest.mark.slow

TOKENS = 48
VARIANTS = [[f"method={m}"] for m in method_names() if m != "baseline"] + [
    ["method=recycling", "method.start=cold", "method.tree=paper-b4"],
]


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("results")


@pytest.fixture(scope="module")
def baseline(run_dir) -> Path:
    return run(config("method=baseline", f"max_new_tokens={TOKENS}", "dtype=float32", "device=cpu",
                      f"run.dir={run_dir}", "run.progress=false"))


def test_baseline_result_file(run_dir):
    path = run(config("method=baseline", "data.limit=2", "max_new_tokens=16", "dtype=float32", "device=cpu",
                      f"run.dir={run_dir / 'smoke'}", "run.progress=false", "warmup=0"))
    meta = json.loads(path.with_name(path.name.replace(".jsonl", ".meta.json")).read_text())
    assert meta["model"] == "smollm2-135m" and meta["dtype"] == "float32" and meta["device"] == "cpu"
    assert meta["question_ids"] == [1, 2] and meta["git_commit"] is not None and meta["versions"]["torch"]
    tokenizer = load_tokenizer(meta["config"]["model"])
    recs = records(path)
    assert [r["question_id"] for r in recs] == [1, 2]
    for r in recs:
        assert {"question_id", "category", "answer_id", "model_id", "tstamp", "choices"} <= r.keys()
        c = r["choices"][0]
        turns = len(c["turns"])
        for key in ("new_tokens", "wall_time", "decoding_steps", "output_ids", "prefill_time", "decode_time"):
            assert len(c[key]) == turns, key
        assert len(c["accept_lengths"]) == sum(c["decoding_steps"]) and set(c["accept_lengths"]) == {1}
        for text, ids, n in zip(c["turns"], c["output_ids"], c["new_tokens"]):
            assert n == len(ids) <= 16
            assert tokenizer.decode(ids, skip_special_tokens=True) == text
        assert all(w >= p + d for w, p, d in zip(c["wall_time"], c["prefill_time"], c["decode_time"]))


@pytest.mark.parametrize("overrides", VARIANTS, ids=[" ".join(v) for v in VARIANTS])
def test_every_method_equals_the_baseline_in_float32(baseline, run_dir, overrides):
    path = run(config(*overrides, f"max_new_tokens={TOKENS}", "dtype=float32", "device=cpu", f"run.dir={run_dir}",
                      "run.progress=false"))
    expected = {r["question_id"]: r["choices"][0]["output_ids"] for r in records(baseline)}
    got = {r["question_id"]: r["choices"][0]["output_ids"] for r in records(path)}
    assert got == expected
    steps = [a for r in records(path) for a in r["choices"][0]["accept_lengths"]]
    assert sum(steps) / len(steps) > 1.0, "a drafter that is never accepted is not being exercised"
    assert equal.main([str(path.parent), "--strict"]) == 0


def test_compare_notebook_runs_on_these_results(run_dir, baseline, monkeypatch):
    notebook = nbformat.read(Path(__file__).parent.parent / "notebooks" / "compare.ipynb", as_version=4)
    monkeypatch.setenv("DRAFTBENCH_RESULTS", str(run_dir))
    NotebookClient(notebook, timeout=300, kernel_name="python3").execute()
