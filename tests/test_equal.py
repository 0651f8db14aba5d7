"""Token-level equality on hand-made result files: identical answers, mismatches, missing and failed questions."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from evaluation import analysis, equal

FIXTURES = Path(__file__).parent / "fixtures" / "analysis"
OURS = FIXTURES / "results" / "tiny" / "mini"
SPEC_BENCH = FIXTURES / "specbench"


def fake_decoder(meta):
    return lambda ids: "".join(f"<{i}>" for i in ids)


def load(stem: str) -> analysis.Run:
    return analysis.load_run(OURS / f"{stem}.jsonl")


@given(st.lists(st.integers(0, 3), max_size=6), st.lists(st.integers(0, 3), max_size=6))
def test_first_divergence(a, b):
    index = equal.first_divergence(a, b)
    if index is None:
        assert a == b
    else:
        assert a[:index] == b[:index] and (index == min(len(a), len(b)) or a[index] != b[index])


def test_mismatch_reports_question_turn_index_and_text():
    report = equal.compare(load("pld-float32-cpu-run0"), load("baseline-float32-cpu-run0"), fake_decoder(None))
    assert (report.n_questions, report.n_identical, report.n_turns, report.n_identical_turns) == (3, 2, 5, 4)
    [mismatch] = report.mismatches
    assert (mismatch.question_id, mismatch.turn, mismatch.index) == (81, 1, 3)
    assert mismatch.baseline == "'<6><7><8>' | '<9><10>'"
    assert mismatch.method == "'<6><7><8>' | '<99><100>'"
    assert report.missing == [f"question 161 not in {OURS / 'pld-float32-cpu-run0.jsonl'}"]
    assert not report.ok


def test_failed_questions_are_reported_not_compared():
    report = equal.compare(load("recycling-paper-float32-cpu-run0"), load("baseline-float32-cpu-run0"),
                           fake_decoder(None))
    assert (report.n_questions, report.n_identical, report.mismatches) == (3, 3, [])
    assert len(report.errors) == 1 and "question 321" in report.errors[0] and "out of memory" in report.errors[0]
    assert not report.ok
    report = equal.compare(load("recycling-paper-float32-cpu-run1"), load("baseline-float32-cpu-run0"),
                           fake_decoder(None))
    assert report.ok and report.n_identical == 4


def test_questions_the_header_lists_but_the_file_lacks_are_missing(tmp_path):
    for suffix in (".jsonl", ".meta.json"):
        shutil.copy(OURS / f"baseline-float32-cpu-run0{suffix}", tmp_path / f"baseline{suffix}")
    meta = json.loads((tmp_path / "baseline.meta.json").read_text())
    (tmp_path / "baseline.meta.json").write_text(json.dumps({**meta, "question_ids": [*meta["question_ids"], 999]}))
    base = analysis.load_run(tmp_path / "baseline.jsonl")
    report = equal.compare(load("recycling-paper-float32-cpu-run1"), base, fake_decoder(None))
    assert len(report.missing) == 2 and all("question 999" in m for m in report.missing)


def test_spec_bench_files_are_compared_by_text():
    report = equal.compare(analysis.load_run(SPEC_BENCH / "vicuna-eagle.jsonl"),
                           analysis.load_run(SPEC_BENCH / "vicuna-vanilla.jsonl"), fake_decoder(None))
    assert report.by_text and report.ok and report.n_identical == 3


def test_cli_strict_fails_on_mismatch_and_reports_everything(capsys):
    assert equal.main([str(OURS), "--strict"], decoder_factory=fake_decoder) == 1
    captured = capsys.readouterr()
    assert "pld run 0 vs baseline run 0" in captured.out
    assert "mismatch: question 81, turn 1, first divergent token 3" in captured.out
    assert "missing: question 161" in captured.out and "question 321 failed" in captured.out
    assert "2 of 3 runs differ" in captured.err
    assert equal.main([str(OURS)], decoder_factory=fake_decoder) == 0


def test_cli_strict_passes_when_identical(capsys):
    args = [str(OURS / "recycling-paper-float32-cpu-run1.jsonl"), "--baseline",
            str(OURS / "baseline-float32-cpu-run0.jsonl"), "--strict", "--json"]
    assert equal.main(args, decoder_factory=fake_decoder) == 0
    [report] = json.loads(capsys.readouterr().out)
    assert (report["label"], report["n_identical"], report["ok"]) == ("recycling-paper", 4, True)


def test_decoder_falls_back_to_token_ids():
    assert equal.tokenizer_decoder(None)([5, 6]) == "5 6"
    assert equal.tokenizer_decoder({"config": {}})([7]) == "7"
