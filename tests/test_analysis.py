"""The speedup math on hand-made result files with known answers, the provenance check, and the CLIs.

Fixture numbers (tests/fixtures/analysis/results/tiny/mini; tokens/s per question = tokens / wall):
  baseline run0:         q81 10 tok/1.0 s, q121 10/2.0, q161 8/2.0, q321 6/1.0  -> 10, 5, 4, 6
  recycling-paper run0:  q81 10/0.5, q121 10/1.0, q161 8/1.0, q321 failed       -> 20, 10, 8, -
  recycling-paper run1:  q81 10/0.4, q121 10/1.0, q161 8/0.8, q321 6/0.5        -> 25, 10, 10, 12
  pld run0:              q81 10/0.8, q121 10/2.0, q161 missing, q321 6/0.5      -> 12.5, 5, -, 12
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from evaluation import analysis, plots, speedup
from evaluation.analysis import NOT_CHECKED, ProvenanceError, ResultError

FIXTURES = Path(__file__).parent / "fixtures" / "analysis"
RESULTS = FIXTURES / "results"
OURS = RESULTS / "tiny" / "mini"
SPEC_BENCH = FIXTURES / "specbench"


def row(table, label, group):
    rows = table[(table["label"] == label) & (table["group"] == group)]
    assert len(rows) == 1, (label, group)
    return rows.iloc[0]


def copy_results(tmp_path: Path, *stems: str) -> Path:
    """A results folder holding the named fixture runs (and their sidecars)."""
    folder = tmp_path / "results" / "tiny" / "mini"
    folder.mkdir(parents=True)
    for stem in stems:
        for suffix in (".jsonl", ".meta.json"):
            shutil.copy(OURS / f"{stem}{suffix}", folder / f"{stem}{suffix}")
    return folder


def edit_meta(path: Path, **changes) -> None:
    meta = json.loads(path.read_text())
    path.write_text(json.dumps({**meta, **changes}))


@pytest.fixture(scope="module")
def ours():
    comparisons, notes = analysis.pair_runs(analysis.load_runs([RESULTS]))
    assert notes == []
    return comparisons


def test_load_run_reads_our_schema():
    run = analysis.load_run(OURS / "recycling-paper-float32-cpu-run0.jsonl")
    assert (run.label, run.method, run.index) == ("recycling-paper", "recycling", 0)
    assert run.setup == ("tiny", "mini", "float32", "cpu")
    assert list(run.ok_ids) == [81, 121, 161]
    assert run.frame.at[321, "error"] == "RuntimeError: out of memory"
    q81 = run.frame.loc[81]
    assert (q81["group"], q81["n_turns"], q81["tokens"], q81["decode_tokens"]) == ("MT", 2, 10, 8)
    assert q81["accept_sum"] == 8 and q81["accept_steps"] == 4
    assert run.frame.at[121, "group"] == "MT"  # coding is an MT-bench category


def test_pairs_each_run_with_its_baseline(ours):
    assert sorted((c.run.label, c.run.index, c.reference.label, c.provenance) for c in ours) == [
        ("baseline", 0, "baseline", "checked"), ("pld", 0, "baseline", "checked"),
        ("recycling-paper", 0, "baseline", "checked"), ("recycling-paper", 1, "baseline", "checked")]


def test_speedup_is_the_ratio_of_mean_tokens_per_s(ours):
    table = analysis.summarize(ours)
    overall = row(table, "recycling-paper", "Overall")
    # run0 over {81,121,161}: (20+10+8)/3 / ((10+5+4)/3) = 2.0; run1 over all four: (25+10+10+12)/(10+5+4+6) = 2.28
    assert overall["speedup"] == pytest.approx((2.0 + 2.28) / 2)
    assert overall["speedup_std"] == pytest.approx(0.28 / 2 ** 0.5)
    assert (overall["n_runs"], overall["n_questions"], overall["n_errors"]) == (2, 3, 1)
    # MAT: run0 accepts [2,2,3,1, 3,4,1, 4,3] = 23/9; run1 adds q321's [5]: 28/10
    assert overall["mat"] == pytest.approx((23 / 9 + 2.8) / 2)
    assert overall["tokens_per_s"] == pytest.approx((38 / 3 + 57 / 4) / 2)
    assert row(table, "recycling-paper", "MT")["speedup"] == pytest.approx((15 / 7.5 + 17.5 / 7.5) / 2)
    assert row(table, "recycling-paper", "Trans")["speedup"] == pytest.approx((8 / 4 + 10 / 4) / 2)
    qa = row(table, "recycling-paper", "QA")  # only run1 answered it
    assert (qa["speedup"], qa["n_questions"], qa["n_errors"]) == (pytest.approx(2.0), 0, 1)
    pld = row(table, "pld", "Overall")  # q161 is missing from pld: compared over {81,121,321}
    assert pld["speedup"] == pytest.approx((12.5 + 5 + 12) / (10 + 5 + 6))
    assert pld["n_questions"] == 3
    assert row(table, "baseline", "Overall")["speedup"] == pytest.approx(1.0)
    assert list(table["label"].drop_duplicates()) == ["baseline", "pld", "recycling-paper"]
    assert list(table.loc[table["label"] == "baseline", "group"]) == ["MT", "Trans", "QA", "Overall"]


def test_total_ratio_speedup(ours):
    overall = row(analysis.summarize(ours, "total"), "recycling-paper", "Overall")
    # run0: 28 tokens / 2.5 s vs 28 / 5.0 s = 2.0; run1: 34 / 2.7 vs 34 / 6.0
    assert overall["speedup"] == pytest.approx((2.0 + 6.0 / 2.7) / 2)


def test_decode_and_prefill_are_reported_apart(ours):
    run0 = next(c for c in ours if c.run.label == "recycling-paper" and c.run.index == 0)
    overall = next(r for r in analysis.run_stats(run0) if r["group"] == "Overall")
    method_decode = (8 / 0.3 + 8 / 0.6 + 7 / 0.7) / 3  # (new tokens - 1 per turn) / decode time
    base_decode = (8 / 0.8 + 8 / 1.6 + 7 / 1.7) / 3
    assert overall["decode_tokens_per_s"] == pytest.approx(method_decode)
    assert overall["decode_speedup"] == pytest.approx(method_decode / base_decode)
    assert overall["prefill_ms"] == pytest.approx(1000 * (0.2 + 0.4 + 0.3) / 5)  # per turn


def test_several_baseline_runs_are_averaged(tmp_path):
    folder = copy_results(tmp_path, "baseline-float32-cpu-run0", "recycling-paper-float32-cpu-run0")
    second = folder / "baseline-float32-cpu-run1.jsonl"
    records = [json.loads(line) for line in (folder / "baseline-float32-cpu-run0.jsonl").read_text().splitlines()]
    for rec in records:
        rec["choices"][0]["wall_time"] = [2 * t for t in rec["choices"][0]["wall_time"]]
    second.write_text("".join(json.dumps(rec) + "\n" for rec in records))
    shutil.copy(folder / "baseline-float32-cpu-run0.meta.json", folder / "baseline-float32-cpu-run1.meta.json")
    edit_meta(folder / "baseline-float32-cpu-run1.meta.json", run=1)
    comparisons, _ = analysis.pair_runs(analysis.load_runs([folder]))
    table = analysis.summarize(comparisons)
    # baseline tokens/s halve in run1: mean over runs of (19/3, 19/6) over {81,121,161}
    assert row(table, "recycling-paper", "Overall")["speedup"] == pytest.approx((38 / 3) / ((19 / 3 + 19 / 6) / 2))
    assert row(table, "baseline", "Overall")["n_runs"] == 2


def test_refuses_differing_provenance_and_force_overrides(tmp_path, capsys):
    folder = copy_results(tmp_path, "baseline-float32-cpu-run0", "recycling-paper-float32-cpu-run0")
    edit_meta(folder / "recycling-paper-float32-cpu-run0.meta.json", dtype="bfloat16", max_new_tokens=16)
    runs = analysis.load_runs([folder])
    with pytest.raises(ProvenanceError) as err:
        analysis.pair_runs(runs)
    message = str(err.value)
    assert "dtype (bfloat16 vs float32)" in message and "max_new_tokens (16 vs 8)" in message
    assert "recycling-paper-float32-cpu-run0.jsonl" in message and "baseline-float32-cpu-run0.jsonl" in message
    assert "--force" in message
    comparisons, _ = analysis.pair_runs(runs, force=True)
    forced = next(c for c in comparisons if c.run.label == "recycling-paper")
    assert forced.provenance.startswith("forced: differs in dtype")
    assert speedup.main([str(folder), "--out", str(tmp_path)]) == 2
    assert "refusing to compare" in capsys.readouterr().err


def test_refuses_a_different_question_set(tmp_path):
    folder = copy_results(tmp_path, "baseline-float32-cpu-run0", "pld-float32-cpu-run0")
    edit_meta(folder / "pld-float32-cpu-run0.meta.json", question_ids=[81, 121, 321])
    with pytest.raises(ProvenanceError, match=r"question_ids \(3 vs 4 questions; e.g. 161\)"):
        analysis.pair_runs(analysis.load_runs([folder]))


def test_named_baseline_is_checked_too(tmp_path):
    folder = copy_results(tmp_path, "pld-float32-cpu-run0", "recycling-paper-float32-cpu-run0")
    edit_meta(folder / "pld-float32-cpu-run0.meta.json", device="cuda")
    with pytest.raises(ProvenanceError, match="device"):
        analysis.pair_runs(analysis.load_runs([folder]), analysis.load_runs([folder / "pld-float32-cpu-run0.jsonl"]))


def test_no_baseline_is_a_clear_error(tmp_path):
    folder = copy_results(tmp_path, "pld-float32-cpu-run0")
    with pytest.raises(ResultError, match="no baseline run"):
        analysis.pair_runs(analysis.load_runs([folder]))


def test_spec_bench_files_with_a_named_baseline():
    runs = analysis.load_runs([SPEC_BENCH])
    vanilla = analysis.load_runs([SPEC_BENCH / "vicuna-vanilla.jsonl"])
    comparisons, _ = analysis.pair_runs(runs, vanilla)
    assert {c.provenance for c in comparisons} == {NOT_CHECKED}
    table = analysis.summarize(comparisons)
    eagle = row(table, "vicuna-eagle", "Overall")
    assert eagle["speedup"] == pytest.approx((50 + 40 + 80) / (20 + 20 + 40))
    assert eagle["mat"] == pytest.approx((18 + 5 + 8) / 11)
    assert eagle["decode_speedup"] != eagle["decode_speedup"]  # n/a: no decode times in Spec-Bench files
    assert eagle["prefill_ms"] != eagle["prefill_ms"]
    assert set(table.loc[table["label"] == "vicuna-eagle", "group"]) == {"MT", "Trans", "Math", "Overall"}
    assert row(table, "vicuna-eagle", "MT")["speedup"] == pytest.approx(2.5)


def test_spec_bench_categories_from_a_question_file():
    categories = analysis.load_categories(FIXTURES / "questions.jsonl")
    run = analysis.load_run(SPEC_BENCH / "vicuna-eagle.jsonl", categories)
    assert run.frame.at[401, "group"] == "RAG"
    assert [analysis.spec_bench_category(q) for q in (81, 95, 160, 161, 320, 401, 560, 561)] == [
        "writing", "roleplay", "humanities", "translation", "summarization", "math_reasoning", "rag", "unknown"]


def test_foreign_files_need_a_named_baseline_or_force(tmp_path):
    folder = copy_results(tmp_path, "baseline-float32-cpu-run0", "recycling-paper-float32-cpu-run0")
    shutil.copy(SPEC_BENCH / "vicuna-eagle.jsonl", folder / "vicuna-eagle.jsonl")
    runs = analysis.load_runs([folder])
    comparisons, notes = analysis.pair_runs(runs)
    assert len(comparisons) == 2 and "vicuna-eagle.jsonl" in notes[0] and "--baseline" in notes[0]
    comparisons, notes = analysis.pair_runs(runs, force=True)
    foreign = next(c for c in comparisons if c.run.label == "vicuna-eagle")
    assert (foreign.provenance, foreign.reference.label, notes) == (NOT_CHECKED, "baseline", [])


def test_unreadable_files_say_what_is_wrong(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question_id": 1}\n')
    with pytest.raises(ResultError, match=r"bad.jsonl:1: missing or malformed field 'choices'"):
        analysis.load_run(bad)
    bad.write_text('{"question_id": 1, "choi')
    with pytest.raises(ResultError, match="truncated"):
        analysis.load_run(bad)
    with pytest.raises(ResultError, match="no such file"):
        analysis.find_result_files([tmp_path / "nowhere"])


def test_speedup_cli_prints_and_writes_the_table(tmp_path, capsys):
    assert speedup.main([str(RESULTS), "--out", str(tmp_path), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    overall = next(r for r in rows if r["label"] == "recycling-paper" and r["group"] == "Overall")
    assert overall["speedup"] == pytest.approx(2.14)
    assert {"speedup", "mat", "tokens_per_s", "n_questions", "n_errors"} <= set(overall)
    assert "2.14 ± 0.20" in (tmp_path / "speedup.md").read_text()
    assert r"2.14 $\pm$ 0.20" in (tmp_path / "speedup.tex").read_text()
    assert "recycling-paper" in (tmp_path / "speedup.csv").read_text()
    assert speedup.main([str(RESULTS), "--out", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "tiny / mini / float32 / cpu" in text and "2.14 ± 0.20" in text


def test_speedup_cli_marks_unchecked_provenance(tmp_path, capsys):
    args = [str(SPEC_BENCH), "--baseline", str(SPEC_BENCH / "vicuna-vanilla.jsonl"), "--out", str(tmp_path)]
    assert speedup.main(args) == 0
    text = capsys.readouterr().out
    assert "vicuna-eagle*" in text and "provenance not checked" in text and "n/a" in text


def test_plots_cli_writes_png_and_svg(tmp_path):
    assert plots.main([str(RESULTS), "--out", str(tmp_path)]) == 0
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == sorted(f"{n}.{ext}" for n in ("speedup_by_group", "mat_vs_speedup", "accept_lengths")
                           for ext in ("png", "svg"))


def test_refuses_a_baseline_from_other_hardware_or_software(tmp_path):
    folder = copy_results(tmp_path, "baseline-float32-cpu-run0", "recycling-paper-float32-cpu-run0")
    for meta, name in (("baseline", "NVIDIA A100-SXM4-80GB"), ("recycling-paper", "NVIDIA GeForce RTX 3090")):
        edit_meta(folder / f"{meta}-float32-cpu-run0.meta.json", device="cuda", device_name=name)
    edit_meta(folder / "recycling-paper-float32-cpu-run0.meta.json", torch_threads=8,
              versions={"torch": "2.9.1", "transformers": "5.24.0"})
    with pytest.raises(ProvenanceError) as err:
        analysis.pair_runs(analysis.load_runs([folder]))
    message = str(err.value)
    assert "device_name (NVIDIA GeForce RTX 3090 vs NVIDIA A100-SXM4-80GB)" in message
    assert "torch_threads (8 vs 1)" in message and "versions.torch (2.9.1 vs 2.13.0)" in message
    assert "transformers" not in message  # the same version on both sides


def test_an_older_header_without_hardware_is_paired_and_marked_unknown(tmp_path, capsys):
    folder = copy_results(tmp_path, "baseline-float32-cpu-run0", "recycling-paper-float32-cpu-run0")
    old = folder / "baseline-float32-cpu-run0.meta.json"
    meta = json.loads(old.read_text())
    del meta["device_name"], meta["torch_threads"], meta["versions"]
    old.write_text(json.dumps(meta))
    comparisons, _ = analysis.pair_runs(analysis.load_runs([folder]))
    recycling = next(c for c in comparisons if c.run.label == "recycling-paper")
    assert recycling.provenance == ("checked except device_name, torch_threads, versions.torch, versions.transformers "
                                    "(unknown: not in an older .meta.json)")
    assert speedup.main([str(folder), "--out", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "recycling-paper*" in text and "* recycling-paper: provenance checked except device_name" in text
    assert "on ?, threads ?, torch ?, transformers ?" in text  # the baseline's own section: its hardware is unknown


def test_the_table_names_the_hardware_of_each_section(tmp_path, capsys):
    folder = copy_results(tmp_path, "baseline-float32-cpu-run0", "recycling-paper-float32-cpu-run0")
    for stem in ("baseline-float32-cpu-run0", "recycling-paper-float32-cpu-run0"):  # the same runs on another CPU
        for suffix in (".jsonl", ".meta.json"):
            shutil.copy(folder / f"{stem}{suffix}", folder / f"{stem.replace('run0', 'run1')}{suffix}")
        edit_meta(folder / f"{stem.replace('run0', 'run1')}.meta.json", run=1, device_name="AMD EPYC 7B13")
    comparisons, _ = analysis.pair_runs(analysis.load_runs([folder]))
    assert {(c.run.platform, c.reference.platform) for c in comparisons} == {
        ("cpu, threads 1, torch 2.13.0, transformers 5.24.0",) * 2,
        ("AMD EPYC 7B13, threads 1, torch 2.13.0, transformers 5.24.0",) * 2}
    table = analysis.summarize(comparisons)
    assert list(table.loc[(table["label"] == "recycling-paper") & (table["group"] == "Overall"), "n_runs"]) == [1, 1]
    assert speedup.main([str(folder), "--out", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "tiny / mini / float32 / cpu on cpu, threads 1, torch 2.13.0, transformers 5.24.0" in text
    assert "tiny / mini / float32 / cpu on AMD EPYC 7B13, threads 1, torch 2.13.0, transformers 5.24.0" in text


def test_a_speedup_within_its_spread_of_one_is_flagged(tmp_path, capsys):
    folder = copy_results(tmp_path, "baseline-float32-cpu-run0", "recycling-paper-float32-cpu-run0",
                          "recycling-paper-float32-cpu-run1")
    slow = folder / "recycling-paper-float32-cpu-run1.jsonl"
    records = [json.loads(line) for line in slow.read_text().splitlines()]
    for rec in records:
        rec["choices"][0]["wall_time"] = [4 * t for t in rec["choices"][0]["wall_time"]]
    slow.write_text("".join(json.dumps(rec) + "\n" for rec in records))
    assert speedup.main([str(folder), "--out", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    overall = next(line for line in text.splitlines() if line.startswith("recycling-paper") and "Overall" in line)
    assert "1.28 ± 1.01†" in overall  # runs at 2.0 and 2.28 / 4 = 0.57: the spread covers 1.0
    assert "† the std over runs is larger than the distance from 1.0" in text
    assert r"1.28 $\pm$ 1.01$^\dagger$" in (tmp_path / "speedup.tex").read_text()
    assert speedup.main([str(RESULTS), "--out", str(tmp_path)]) == 0
    assert "†" not in capsys.readouterr().out  # 2.14 ± 0.20 is clear of 1.0
