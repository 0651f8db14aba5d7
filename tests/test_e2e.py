"""End to end on the real embedded model (SmolLM2-135M-Instruct, float32, CPU).

The equality test is the product's promise: every method's output ids equal the baseline's on every
question of spec_bench_mini. Slow (minutes): marked, and run by `make test` and CI. Under pytest-xdist
(`make test` runs two workers) every run is made once per session and shared by the workers.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import nbformat
import pytest
from filelock import FileLock
from nbclient import NotebookClient

from evaluation import equal
from evaluation.models import load_tokenizer
from evaluation.run import run
from helpers import config, method_names

pytestmark = pytest.mark.slow

TOKENS = 32
VARIANTS = [[f"method={m}"] for m in method_names() if m not in ("baseline", "eagle")] + [
    ["method=recycling", "method.start=cold", "method.tree=paper-b4"],
    # the shipped head (methods/eagle/heads/smollm2-135m) over its draft vocabulary: the CPU default (the static
    # paper-b2 tree) and a small EAGLE-2 dynamic tree
    ["method=eagle"],
    ["method=eagle", "method.tree=dynamic", "method.total_tokens=8", "method.depth=3", "method.top_k=2"],
]


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="session")
def shared_dir(tmp_path_factory) -> Path:
    """A folder all xdist workers of this session share (pytest-xdist's documented pattern)."""
    root = tmp_path_factory.getbasetemp()
    return root.parent / "e2e" if os.environ.get("PYTEST_XDIST_WORKER") else root / "e2e"


def shared_run(shared_dir: Path, *overrides: str) -> Path:
    """The result file of a spec_bench_mini run with ``overrides``, made once per session: the first
    worker to ask runs it under a lock, the others wait for it and read its path."""
    shared_dir.mkdir(parents=True, exist_ok=True)
    key = hashlib.sha1(" ".join(overrides).encode()).hexdigest()[:16]
    with FileLock(shared_dir / f"{key}.lock"):
        done = shared_dir / f"{key}.path"
        if not done.exists():
            path = run(config(*overrides, f"max_new_tokens={TOKENS}", "dtype=float32", "device=cpu",
                              f"run.dir={shared_dir / 'results'}", "run.progress=false"))
            done.write_text(str(path))
    return Path(done.read_text())


def test_baseline_result_file(tmp_path):
    path = run(config("method=baseline", "data.limit=2", "max_new_tokens=16", "dtype=float32", "device=cpu",
                      f"run.dir={tmp_path}", "run.progress=false", "warmup=0"))
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
def test_every_method_equals_the_baseline_in_float32(shared_dir, overrides):
    path = shared_run(shared_dir, *overrides)  # before the baseline: another worker may be making it meanwhile
    baseline = shared_run(shared_dir, "method=baseline")
    expected = {r["question_id"]: r["choices"][0]["output_ids"] for r in records(baseline)}
    got = {r["question_id"]: r["choices"][0]["output_ids"] for r in records(path)}
    assert got == expected
    steps = [a for r in records(path) for a in r["choices"][0]["accept_lengths"]]
    assert sum(steps) / len(steps) > 1.0, "a drafter that is never accepted is not being exercised"
    assert equal.main([str(baseline), str(path), "--strict"]) == 0  # files: other runs may be in progress


def test_compare_notebook_runs_on_these_results(shared_dir, monkeypatch):
    for overrides in [["method=baseline"], *VARIANTS]:  # every run complete: none is being written meanwhile
        shared_run(shared_dir, *overrides)
    notebook = nbformat.read(Path(__file__).parent.parent / "notebooks" / "compare.ipynb", as_version=4)
    monkeypatch.setenv("DRAFTBENCH_RESULTS", str(shared_dir / "results"))
    NotebookClient(notebook, timeout=None, kernel_name="python3").execute()
