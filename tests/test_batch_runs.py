"""batch_size=B through the harness: result files, interleaved runs, the analysis by batch size, the calibration and
plans per batch size, the experiment that sweeps B (methods.batch's own tests: tests/test_batch.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
from hydra import initialize_config_dir

from evaluation import analysis, autotree, calibrate, equal, plots, speedup, steps, store
from evaluation.analysis import ProvenanceError
from evaluation.interleave import interleave, method_configs
from evaluation.results import meta_path
from evaluation.run import run, run_label
from helpers import CONF, config, tiny_checkpoint
from methods.costs import crossover, describe_crossover
from test_reliability import questions, records, tiny_args

CAL = ["calibration.sizes=[1,2,4,8]", "calibration.contexts=[16,48]", "calibration.min_rounds=1",
       "calibration.budget_s=0"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return tiny_checkpoint(tmp_path_factory.mktemp("tiny"), max_positions=96, ends=False)  # answers run to the budget


def outputs(path: Path) -> dict:
    return {r["question_id"]: r["choices"][0]["output_ids"] for r in records(path)}


def test_a_batched_run_equals_one_at_a_time_and_records_its_rows(checkpoint, tmp_path):
    data = questions(tmp_path / "q.jsonl", 5)
    single = run(config(*tiny_args(checkpoint, data, tmp_path / "out", tokens=20)))
    batched = run(config(*tiny_args(checkpoint, data, tmp_path / "out", tokens=20), "batch_size=2"))
    assert batched.name == single.name.replace("-hot-", "-hot-b2-")  # recycling-paper-k8-hot-b2-float32-cpu-run0
    assert outputs(batched) == outputs(single)
    meta, single_meta = (json.loads(meta_path(p).read_text()) for p in (batched, single))
    assert (meta["batch_size"], meta["label"], single_meta["batch_size"]) == (2, "recycling-paper-k8-hot-b2", 1)
    rows = [r["batch"] for r in records(batched)]
    assert {b["size"] for b in rows} == {2} and {b["slot"] for b in rows} == {0, 1}
    assert all(b["wall_time"] > 0 and b["finished"] - b["started"] == pytest.approx(b["wall_time"]) for b in rows)
    assert "batch" not in records(single)[0]


def test_an_interleaved_batched_run_serves_every_method_step_by_step(checkpoint, tmp_path):
    data = questions(tmp_path / "q.jsonl", 4)
    shared = [a for a in tiny_args(checkpoint, data, tmp_path / "out", tokens=20) if not a.startswith("method=")]
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        configs = method_configs(["baseline", "recycling:tree=paper-b3", "pld"], [*shared, "batch_size=2"])
    paths = interleave(configs)
    labels = [json.loads(meta_path(p).read_text())["label"] for p in paths]
    base, tr, pld = (label.removesuffix("-b2") for label in labels)
    assert labels == [run_label(c) for c in configs] and (base, tr) == ("baseline", "recycling-paper-b3-k8-hot")
    alone = run(config(*shared, "method=baseline"))
    assert all(outputs(p) == outputs(alone) for p in paths)
    assert json.loads(meta_path(paths[0]).read_text())["interleaved_with"] == labels[1:]

    table = analysis.summarize(analysis.pair_runs(analysis.load_runs([tmp_path / "out"]))[0])
    batch = analysis.batch_table(table)
    assert set(zip(batch["series"], batch["batch_size"])) == {(base, 1), (base, 2), (tr, 2), (pld, 2)}
    row = batch[(batch["series"] == pld) & (batch["batch_size"] == 2)].iloc[0]
    assert row["total_speedup"] == pytest.approx(row["total_tokens_per_s"] / row["baseline_total_tokens_per_s"])
    single = batch[(batch["series"] == base) & (batch["batch_size"] == 1)].iloc[0]["total_tokens_per_s"]
    assert row["vs_batch1"] == pytest.approx(row["total_tokens_per_s"] / single)
    pairs = {c.run.label: c.reference.label for c in analysis.pair_runs(analysis.load_runs([tmp_path / "out"]))[0]}
    assert pairs[labels[2]] == "baseline-b2" and pairs["baseline"] == "baseline"
    text = speedup.format_batch(batch)
    assert "Speedup by batch size" in text and f"measured: {pld}:" in text

    comparisons = analysis.pair_runs(analysis.load_runs([tmp_path / "out"]))[0]
    checked = {c.run.label: r for c, r in equal.check(comparisons, lambda meta: str)}
    assert {label: r.baseline_label for label, r in checked.items()} == dict.fromkeys(labels, "baseline")
    assert all(r.ok and r.n_questions == 4 for r in checked.values())  # every row equals batch-1 decoding
    stems = [stem for stem, _, _ in plots.figures(table, comparisons)]
    assert "batch_speedup" in stems


def fake_run(folder: Path, label: str, batch: int | None, tokens: list[int], times: list[float],
             method: str = "baseline") -> Path:
    """A result file with a header (``batch`` None: an old header without batch_size) and one record per question."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{label}.jsonl"
    meta = {"model": "m", "data": "d", "dtype": "float32", "device": "cpu", "method": method, "label": label,
            "max_new_tokens": 8, "question_ids": list(range(len(tokens))), "run": 0}
    if batch is not None:
        meta["batch_size"] = batch
    meta_path(path).write_text(json.dumps(meta))
    lines = []
    for i, (n, t) in enumerate(zip(tokens, times)):
        choice = {"new_tokens": [n], "wall_time": [t], "output_ids": [list(range(n))], "accept_lengths": [1] * n}
        record = {"question_id": i, "category": "qa", "choices": [choice]}
        if batch and batch > 1:  # two questions at once, on the engine's clock
            record["batch"] = {"size": batch, "slot": i % batch, "session": "s", "started": float(i // batch),
                               "finished": i // batch + t, "wall_time": t}
        lines.append(json.dumps(record))
    path.write_text("\n".join(lines) + "\n")
    return path


def test_a_method_is_paired_only_with_a_baseline_of_its_batch_size(tmp_path):
    fake_run(tmp_path, "baseline", None, [8, 8], [1.0, 1.0])  # an old header: batch size 1
    fake_run(tmp_path, "pld-b2", 2, [8, 8], [1.0, 1.0], method="pld")
    with pytest.raises(ProvenanceError, match=r"batch_size \(2 vs 1\)"):
        analysis.pair_runs(analysis.load_runs([tmp_path]))
    fake_run(tmp_path, "baseline-b2", 2, [8, 8], [2.0, 2.0])
    pairs = {c.run.label: c.reference.label for c in analysis.pair_runs(analysis.load_runs([tmp_path]))[0]}
    assert pairs == {"baseline": "baseline", "pld-b2": "baseline-b2", "baseline-b2": "baseline-b2"}


def test_total_tokens_per_s_is_over_the_serving_time(tmp_path):
    """Two questions at once, each 1 s: 16 tokens in 1 s in all, 8 tokens/s per sequence."""
    fake_run(tmp_path, "baseline", 1, [8, 8], [1.0, 1.0])
    fake_run(tmp_path, "baseline-b2", 2, [8, 8], [1.0, 1.0])
    table = analysis.summarize(analysis.pair_runs(analysis.load_runs([tmp_path]))[0])
    batch = analysis.batch_table(table).set_index("batch_size")
    assert batch.loc[1, "total_tokens_per_s"] == pytest.approx(8.0) and batch.loc[2, "tokens_per_s"] == pytest.approx(8)
    assert batch.loc[2, "total_tokens_per_s"] == pytest.approx(16.0) and batch.loc[2, "vs_batch1"] == pytest.approx(2.0)


def test_the_crossover_is_the_last_batch_size_that_pays():
    assert crossover({1: 1.4, 2: 1.1, 4: 0.9, 8: 1.05}) == (2, 4)  # the first loss decides
    assert crossover({1: 1.2, 2: 1.0}) == (2, None) and crossover({2: 0.8}) == (None, 2)
    assert describe_crossover({1: 1.4, 2: 1.1, 4: 0.9}) == "pays up to batch size 2, loses from 4"


def test_the_label_names_the_batch_size_only_above_one():
    assert run_label(config("method=baseline")) == "baseline"
    assert run_label(config("method=baseline", "batch_size=4")) == "baseline-b4"
    assert run_label(config("method=baseline", "batch_size=4", "sampling.temperature=1")) == "baseline-T1-b4"


def test_the_calibration_adds_batch_sizes_and_plans_per_batch_size(checkpoint, tmp_path):
    args = ["model=hf", f"model.path={checkpoint}", "dtype=float32", "device=cpu", "threads=1",
            f"autotree.dir={tmp_path}", *CAL]
    path = calibrate.calibrate(config(*args, name="calibrate"))
    single = store.Calibration.load(path)
    assert single.batch_sizes == (1,) and json.loads(path.read_text())["key"]["batch_sizes"] == [1]
    calibrate.calibrate(config(*args, "calibration.batch_sizes=[1,2]", "batch_size=3", name="calibrate"))
    both = store.Calibration.load(path)
    assert both.batch_sizes == (1, 2, 3) and both.samples_ms == single.samples_ms  # batch 1 kept as it was
    assert json.loads(path.read_text())["key"]["batch_sizes"] == [1, 2, 3]
    assert both.curve_at(3).seconds(8, 16) > 0 and both.padding_at(2).sizes

    run_args = ["model=hf", f"model.path={checkpoint}", "dtype=float32", "device=cpu", "threads=1",
                f"autotree.dir={tmp_path}"]
    import torch
    padding, facts = autotree.padding(config(*run_args, "batch_size=2"), torch.device("cpu"), torch.float32)
    assert facts["enabled"] and facts["batch_size"] == 2
    padding, facts = autotree.padding(config(*run_args, "batch_size=4"), torch.device("cpu"), torch.float32)
    assert padding is None and "batch size 4" in facts["why"]
    with pytest.raises(store.AutoTreeError, match=r"batch_size=4.*calibration.batch_sizes=\[4\]"):
        autotree.padding(config(*run_args, "batch_size=4", "autotree.pad=true"), torch.device("cpu"), torch.float32)


def test_the_predicted_crossover_uses_the_calibrated_step_over_b_rows(tmp_path):
    from methods.costs import CostCurve
    sizes, contexts = (1, 2, 4, 8), (16, 64)

    def samples(per_token):
        return [[[10 + per_token * (q - 1)] * 2 for q in sizes] for _ in contexts]

    flat, steep = CostCurve.from_samples(contexts, sizes, samples(0.5)), CostCurve.from_samples(contexts, sizes,
                                                                                               samples(20))
    run_steps = [(20, 8, [0, 0])] * 10  # 8 tokens fed, 3 emitted a step
    assert steps.predicted_speedup(run_steps, flat) == pytest.approx(3 * 10 / 13.5)
    assert steps.predicted_speedup(run_steps, steep) < 1
    # at B rows a step feeds its largest row's block: a quarter of the steps drafting 7 tokens make most 4-row steps
    mixed = [(20, 8, [0] * 4)] * 5 + [(20, 1, [])] * 15
    t1, t8 = steep.seconds(1, 20), steep.seconds(8, 20)
    alone = (0.75 * t1 + 0.25 * t8)
    batched = 0.75 ** 4 * t1 + (1 - 0.75 ** 4) * t8
    assert steps.predicted_speedup(mixed, steep, rows=4) == pytest.approx(
        steps.predicted_speedup(mixed, steep) * alone / batched)


def test_the_batch_experiment_sweeps_b_in_interleaved_runs():
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        from hydra import compose
        cfg = compose("interleave", overrides=["+experiment=batch_cpu"], return_hydra_config=True)
    assert list(cfg.methods) == ["baseline", "pld", "recycling:tree=auto", "sam:mode=auto,aux_tree=auto"]
    assert str(cfg.hydra.sweeper.params.batch_size) == "1,2,4,8"
    assert (cfg.data.name, cfg.data.per_category, cfg.max_new_tokens) == ("spec_bench", 10, 128)


def make(*args: str) -> list[str]:
    """The commands ``make`` would run (PY=echo prints them), without installing or fetching anything."""
    import shutil
    import subprocess

    if not shutil.which("make"):
        pytest.skip("make is not installed")
    return subprocess.run(["make", "-s", "-C", str(Path(CONF).parent), "-o", ".venv/.installed", "-o", "data", *args,
                           "PY=echo"], capture_output=True, text=True, check=True).stdout.splitlines()


def test_make_runs_the_batch_experiment_interleaved_and_calibrates_batch_sizes():
    out = make("bench", "EXPERIMENT=batch_cpu")
    assert out[0].split()[:4] == ["-m", "evaluation.interleave", "-m", "+experiment=batch_cpu"]
    assert make("bench", "EXPERIMENT=readme_cpu")[0].split()[:3] == ["-m", "evaluation.run", "-m"]
    calibrations = [line for line in make("calibrate", "METHODS=recycling:tree=auto", "BATCH_SIZES=1 2 4 8")
                    if "evaluation.calibrate" in line]
    assert "calibration.batch_sizes=[1,2,4,8]" in calibrations[0]
    bench = make("bench", "ARGS=batch_size=4", "METHODS=baseline recycling:tree=auto")
    assert any("evaluation.calibrate" in line and "batch_size=4" in line for line in bench)
    assert any("evaluation.interleave" in line and "batch_size=4" in line for line in bench)


def test_speedup_prints_the_batch_table(tmp_path, capsys):
    fake_run(tmp_path, "baseline", 1, [8, 8], [1.0, 1.0])
    fake_run(tmp_path, "baseline-b2", 2, [8, 8], [1.0, 1.0])
    fake_run(tmp_path, "pld-b2", 2, [8, 8], [2.0, 2.0], method="pld")
    assert speedup.main([str(tmp_path), "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "Speedup by batch size" in out and "measured: pld: loses already at batch size 2" in out
    assert pd.read_csv(tmp_path / "out" / "batch.csv")["batch_size"].tolist() == [1, 2, 2]


def test_prefilling_rows_together_gives_the_same_first_tokens():
    """evaluation.batch_prefill's two ways (its timing is for an idle machine, not a test)."""
    from conftest import VOCAB
    from evaluation.batch_prefill import compare, one_by_one, together
    from evaluation.tiny import tiny_llama
    from methods.batch import BatchEngine
    from methods.engine import Engine

    engine = Engine(tiny_llama(), set())
    prompts = [[1, 2, 3, 4, 5], [9, 8], [7, 7, 7, 7, 7, 7, 7, 7, 1], [3]]
    batch = BatchEngine(engine, 4)
    assert together(batch, prompts) == one_by_one(batch, prompts, VOCAB)
    result = compare(engine, 2, prompts, repeats=1)
    assert result["groups"] == 2 and result["first_tokens_changed"] == 0


@pytest.mark.slow
def test_smollm2_rows_equal_batch_1_on_spec_bench_mini(tmp_path):
    """The embedded model in float32 at B=2, a few methods interleaved on a few questions (two turns each, rows of
    different lengths refilled): every row equals the batch-1 baseline's output, token by token."""
    common = ["data.limit=3", "max_new_tokens=12", "dtype=float32", "device=cpu", "threads=1", "warmup=0",
              f"run.dir={tmp_path}", "run.progress=false"]
    run(config("method=baseline", *common))
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        configs = method_configs(["baseline", "recycling:tree=paper-b3", "pld", "sam"], [*common, "batch_size=2"])
    interleave(configs)
    comparisons = analysis.pair_runs(analysis.load_runs([tmp_path]))[0]
    checked = equal.check(comparisons, lambda meta: str)
    assert len(checked) == 4 and all(r.baseline_label == "baseline" for _, r in checked)
    assert all(r.ok and r.n_questions == 3 for _, r in checked), [equal.format_report(r, "") for _, r in checked]


def test_auto_plans_at_a_batch_size_from_its_calibration_and_batch_1_statistics(tmp_path):
    """make bench ARGS=batch_size=2 in small: the calibration measures B=2, the statistics are collected at batch
    size 1, and tree=auto and SAM's mode=auto plan with the step over two rows; every row stays batch 1's."""
    from evaluation.acceptance import collect, collect_policy

    checkpoint = tiny_checkpoint(tmp_path / "ckpt", max_positions=256)
    words = "a b c d e f g h".split()

    def asked(name: str, offset: int) -> Path:
        lines = [json.dumps({"question_id": i, "category": "qa",
                             "turns": [" ".join((words[(i + offset) % 8:] + words[:(i + offset) % 8]) * 3)]})
                 for i in range(4)]
        (tmp_path / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
        return tmp_path / f"{name}.jsonl"

    common = ["model=hf", f"model.path={checkpoint}", "model.template=plain", "max_new_tokens=24", "dtype=float32",
              "device=cpu", "threads=1", f"autotree.dir={tmp_path / 'calibration'}", "run.progress=false", "warmup=0",
              "batch_size=2"]
    calibrate.calibrate(config(*common, *CAL, name="calibrate"))
    recycling = ["method=recycling", "method.tree=auto"]
    stats = collect(config(*common, f"data.path={asked('calib', 0)}", *recycling))
    source = json.loads(stats.read_text())["provenance"]["result_file"]
    assert "-b2" not in Path(source).name  # collected one sequence at a time
    sam = ["method=sam", "method.mode=auto", "method.aux_tree=auto", "method.threshold=2"]
    collect_policy(config(*common, f"data.path={asked('calib', 0)}", *sam))
    out = [f"data.path={asked('eval', 4)}", f"run.dir={tmp_path / 'results'}"]
    single = run(config(*[c for c in common if c != "batch_size=2"], *out, "method=baseline"))
    for method, plan in ((recycling, "plan"), (sam, "policy")):
        path = run(config(*common, *out, *method))
        meta = json.loads(meta_path(path).read_text())
        assert meta["batch_size"] == 2 and meta["drafter"][plan]["sources"]["batch_size"] == 2
        assert meta["padding"]["batch_size"] == 2
        assert outputs(path) == outputs(single)


def test_a_stopped_batched_run_abandons_its_rows_and_its_rerun_completes_it(tmp_path):
    """SIGTERM while two questions are in flight: both abandoned (nothing of them written), exit 75, and the same
    command again answers them; every answer equals an uninterrupted run's."""
    import signal
    import sys

    from evaluation import signals
    from test_survival import STOP_MESSAGE, interrupt

    checkpoint = tiny_checkpoint(tmp_path / "long", ends=False)  # answers run to the budget: tens of ms a question
    data = questions(tmp_path / "q.jsonl", 6)
    reference = run(config(*tiny_args(checkpoint, data, tmp_path / "whole", tokens=200), "batch_size=2"))
    args = [*tiny_args(checkpoint, data, tmp_path / "stopped", tokens=200), "batch_size=2"]
    target = tmp_path / "stopped" / reference.relative_to(tmp_path / "whole")
    code = interrupt([sys.executable, "-m", "evaluation.run", *args], target, signal.SIGTERM, tmp_path / "log")
    stop = STOP_MESSAGE.search((tmp_path / "log").read_text())
    assert code == signals.EXIT_STOPPED and stop is not None, (tmp_path / "log").read_text()
    recorded = [r["question_id"] for r in records(target)]
    assert 2 <= len(recorded) < 6 and len(set(recorded)) == len(recorded)
    run(config(*args))
    ids = [r["question_id"] for r in records(target)]
    assert sorted(ids) == list(range(6)) and outputs(target) == outputs(reference)
