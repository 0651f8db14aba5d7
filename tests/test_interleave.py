"""Interleaved runs: several methods answer in turn on one loaded model, each exactly as it would alone."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import initialize_config_dir

from evaluation.interleave import MethodsError, interleave, method_configs, method_overrides
from evaluation.results import meta_path
from evaluation.run import run
from helpers import CONF, PROJECT_ROOT, config, tiny_checkpoint
from test_reliability import questions, records, tiny_args

METHODS = ["baseline", "recycling:tree=paper-b3", "pld"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return tiny_checkpoint(tmp_path_factory.mktemp("tiny"), max_positions=96)


def shared(checkpoint: Path, data: Path, out: Path) -> list[str]:
    return [a for a in tiny_args(checkpoint, data, out, tokens=30) if not a.startswith("method=")]


def configs(methods: list[str], overrides: list[str]):
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        return method_configs(methods, overrides)


def test_each_method_does_exactly_what_it_does_alone(checkpoint, tmp_path):
    data = questions(tmp_path / "q.jsonl", 5)
    paths = interleave(configs(METHODS, shared(checkpoint, data, tmp_path / "together")))
    for entry, path in zip(METHODS, paths):
        alone = run(config(*shared(checkpoint, data, tmp_path / "alone"), *method_overrides(entry)))
        assert path.relative_to(tmp_path / "together") == alone.relative_to(tmp_path / "alone")
        got, want = records(path), records(alone)
        assert [r["question_id"] for r in got] == list(range(5))
        for mine, theirs in zip(got, want):  # the same tokens and, hot state kept apart, the same drafts
            assert mine["choices"][0]["output_ids"] == theirs["choices"][0]["output_ids"]
            assert mine["choices"][0]["accept_lengths"] == theirs["choices"][0]["accept_lengths"]
        others = [p.name.split("-float32")[0] for p in paths if p != path]
        assert json.loads(meta_path(path).read_text())["interleaved_with"] == others
        assert "interleaved_with" not in json.loads(meta_path(alone).read_text())


def test_the_order_rotates_with_the_question(checkpoint, tmp_path):
    data = questions(tmp_path / "q.jsonl", 3)
    paths = interleave(configs(METHODS, shared(checkpoint, data, tmp_path / "out")))
    stamps = [[r["tstamp"] for r in records(p)] for p in paths]
    firsts = [min(range(3), key=lambda m: stamps[m][q]) for q in range(3)]
    assert firsts == [0, 1, 2]


def test_an_interrupted_interleaved_run_resumes_each_method_where_it_stopped(checkpoint, tmp_path):
    data = questions(tmp_path / "q.jsonl", 4)
    args = shared(checkpoint, data, tmp_path / "out")
    paths = interleave(configs(METHODS, args))
    whole = [records(p) for p in paths]
    lines = paths[1].read_text().splitlines(keepends=True)
    paths[1].write_text("".join(lines[:2]) + lines[2][:10])  # killed while writing its third question
    interleave(configs(METHODS, args))
    again = [records(p) for p in paths]
    assert [len(r) for r in again] == [4, 4, 4]
    assert again[0] == whole[0] and again[2] == whole[2]  # the finished methods were not rerun
    assert [r["choices"][0]["output_ids"] for r in again[1]] == [r["choices"][0]["output_ids"] for r in whole[1]]


def test_a_sequential_file_is_not_resumed_by_an_interleaved_run(checkpoint, tmp_path):
    data = questions(tmp_path / "q.jsonl", 2)
    alone = run(config(*shared(checkpoint, data, tmp_path / "out"), "method=baseline"))
    before = alone.read_bytes()
    with pytest.raises(Exception, match="interleaved_with"):
        interleave(configs(["baseline", "pld"], shared(checkpoint, data, tmp_path / "out")))
    assert alone.read_bytes() == before


@pytest.mark.parametrize("methods, overrides, message", [
    (["recycling", "recycling"], [], "appear twice"),
    (["recycling:tree"], [], "NAME:key=value"),
    ([], [], "methods is empty"),
    (["baseline"], ["method.k=4"], "inside the methods entries"),
])
def test_bad_methods_are_refused_before_anything_runs(methods, overrides, message):
    with pytest.raises(MethodsError, match=message):
        configs(methods, overrides)


def test_the_command_line(checkpoint, tmp_path):
    data = questions(tmp_path / "q.jsonl", 2)
    args = shared(checkpoint, data, tmp_path / "out")
    cmd = [sys.executable, "-m", "evaluation.interleave", 'methods=[baseline,"recycling:tree=chain6,k=4"]', *args]
    subprocess.run(cmd, cwd=PROJECT_ROOT, check=True, capture_output=True)
    made = sorted(p.name for p in (tmp_path / "out").rglob("*.jsonl"))
    assert made == ["baseline-float32-cpu-run0.jsonl", "recycling-chain6-k4-hot-float32-cpu-run0.jsonl"]
    bad = subprocess.run([*cmd, "method=pld"], cwd=PROJECT_ROOT, capture_output=True, text=True)
    assert bad.returncode != 0 and "inside the methods entries" in bad.stderr


def test_make_bench_interleaves_methods_as_written():
    import shutil

    from hydra.core.override_parser.overrides_parser import OverridesParser

    if not shutil.which("make"):
        pytest.skip("make is not installed")
    methods = ["baseline", "pld", "sam:aux=none,mode=auto"]
    out = subprocess.run(["make", "-s", "-C", str(PROJECT_ROOT), "-o", ".venv/.installed", "-o", "data", "-o", "calibrate",
                          "bench", "PY=echo", f"METHODS={' '.join(methods)}"],
                         capture_output=True, text=True, check=True).stdout.splitlines()
    command = next(line.split() for line in out if "evaluation.interleave" in line)
    listed = next(arg for arg in command if arg.startswith("methods="))
    assert OverridesParser.create().parse_override(listed).value() == methods


def test_the_speedup_table_says_which_methods_were_timed_in_turn(checkpoint, tmp_path, capsys):
    from evaluation import speedup

    data = questions(tmp_path / "q.jsonl", 2)
    interleave(configs(["baseline", "pld"], shared(checkpoint, data, tmp_path / "out")))
    run(config(*shared(checkpoint, data, tmp_path / "out"), "method=recycling"))
    assert speedup.main([str(tmp_path / "out")]) == 0
    notes = [line for line in capsys.readouterr().out.splitlines() if "timed" in line]
    assert notes == ["timed apart from the baseline (one run after another, so a drift in the machine's speed enters "
                     "the speedup; evaluation.interleave times them in turn): recycling-paper-k8-hot"]
    next((tmp_path / "out").rglob("recycling-*.jsonl")).unlink()
    assert speedup.main([str(tmp_path / "out")]) == 0
    assert "every method was timed in turn with the baseline" in capsys.readouterr().out
