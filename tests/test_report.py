"""evaluation.report on the analysis fixtures (tests/test_analysis.py gives their numbers): its tables equal what
evaluation.speedup and evaluation.equal print as JSON, its caveats follow the headers and timings, the commands
recompose the recorded configs, and the HTML page renders in headless Chromium."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from matplotlib import image
from omegaconf import OmegaConf

from evaluation import analysis, equal, report, speedup
from helpers import config

OURS = Path(__file__).parent / "fixtures" / "analysis" / "results" / "tiny" / "mini"
SECTION = "tiny / mini / float32 / cpu on cpu, threads 1, torch 2.13.0, transformers 5.24.0"
BROWSERS = ("chromium", "chromium-browser", "google-chrome")


def fake_decoder(meta):
    return lambda ids: "".join(f"<{i}>" for i in ids)


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    """A copy of the fixture runs: the report is written beside them."""
    return Path(shutil.copytree(OURS, tmp_path / "results" / "tiny" / "mini"))


def keep(folder: Path, *stems: str) -> None:
    for path in folder.iterdir():
        if path.is_file() and not path.name.startswith(stems):
            path.unlink()


def edit_meta(path: Path, **changes) -> None:
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}, sort_keys=True))


def edit_records(path: Path, edit) -> None:
    records = [json.loads(line) for line in path.read_text().splitlines()]
    path.write_text("".join(json.dumps(edit(rec)) + "\n" for rec in records))


def make_report(folder: Path, capsys, out: Path | None = None) -> tuple[str, dict]:
    """Run the CLI on ``folder``; the Markdown and JSON it wrote (in ``out``, by default beside the runs)."""
    assert report.main([str(folder), *(["--out", str(out)] if out else [])], decoder_factory=fake_decoder) == 0
    out = out or folder
    printed = capsys.readouterr().out.split()
    assert printed[:3] == [str(out / f"report.{ext}") for ext in ("md", "html", "json")]
    assert all(Path(p).is_file() for p in printed)
    return (out / "report.md").read_text(), json.loads((out / "report.json").read_text())


def section(markdown: str, heading: str) -> str:
    """The text under ``## heading``, up to the next section."""
    return markdown.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0].strip()


def tables(text: str) -> list[tuple[str, list[str], list[list[str]]]]:
    """(### heading above it, header cells, row cells) of every Markdown table in ``text``."""
    found, heading, lines = [], None, text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("### "):
            heading = line[4:]
        if line.startswith("| ") and (i == 0 or not lines[i - 1].startswith("|")):
            block = []
            for row in lines[i:]:
                if not row.startswith("|"):
                    break
                block.append([c.strip() for c in row.strip().strip("|").split("|")])
            assert set("".join(block[1])) <= set("-: "), block[1]  # the alignment row
            found.append((heading, block[0], block[2:]))
    return found


def shown(value: float | None, decimals: int) -> str:
    return "n/a" if value is None else f"{value:.{decimals}f}"


def test_the_speedup_table_is_evaluation_speedups(folder, tmp_path, capsys):
    markdown, data = make_report(folder, capsys)
    assert speedup.main([str(folder), "--json", "--out", str(tmp_path / "speedup")]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert data["speedup"] == rows
    found = tables(section(markdown, "Speedup"))
    assert [heading for heading, _, _ in found] == [SECTION]
    _, header, cells = found[0]
    assert header == [h for h, _, _ in speedup.COLUMNS]
    assert len(cells) == len(rows)
    for line, row in zip(cells, rows):  # in the table's order
        assert f"{analysis.setup_name([row[k] for k in analysis.SETUP_KEYS])} on {row['platform']}" == SECTION
        for (_, column, decimals), cell in zip(speedup.COLUMNS, line):
            if decimals is None:
                marks = ("*" if row["provenance"] != analysis.CHECKED else "") + (speedup.PARTIAL if row["partial"] else "")
                assert cell == str(row[column]) + (marks if column == "label" else ""), column
                continue
            mean, _, std = cell.removesuffix(speedup.NOISY).partition(" ± ")
            assert mean == shown(row[column], decimals), (row["label"], row["group"], column)
            # counts and the baseline's tok/s have no std; a std over one answered run is n/a (None): not shown
            spread = row["n_runs"] > 1 and row.get(f"{column}_std") is not None
            assert std == (shown(row[f"{column}_std"], decimals) if spread else "")
    overall = next(line for line in cells if line[:2] == ["recycling-paper", "Overall"])
    assert overall[5] == "2.14 ± 0.20"  # tests/test_analysis.py's number


def test_the_equality_summary_is_evaluation_equals(folder, capsys):
    markdown, data = make_report(folder, capsys)
    assert equal.main([str(folder), "--json"], decoder_factory=fake_decoder) == 0
    reports = json.loads(capsys.readouterr().out)
    assert data["equality"] == reports
    text = section(markdown, "Equality")
    [(heading, header, cells)] = tables(text)
    assert heading == SECTION and header == list(report.EQUALITY_COLUMNS)
    assert len(cells) == len(reports) == 3
    for line, r in zip(cells, reports):
        assert line == [r["label"], str(r["run"]), f"{r['baseline_label']} run {r['baseline_run']}",
                        f"{r['n_identical']}/{r['n_questions']}", f"{r['n_identical_turns']}/{r['n_turns']}",
                        str(len(r["mismatches"])), str(len(r["missing"])), str(len(r["errors"])),
                        "yes" if r["ok"] else "no"]
    assert text.startswith("2 of 3 runs differ from their baseline")
    assert ("pld run 0: question 81, turn 1, first divergent token 3: baseline `'<6><7><8>' | '<9><10>'`, "
            "pld `'<6><7><8>' | '<99><100>'`") in text


def test_sections_setup_and_the_caveats_the_analysis_knows(folder, capsys):
    markdown, data = make_report(folder, capsys)
    headings = re.findall(r"^## (.+)$", markdown, re.MULTILINE)
    assert headings == ["Summary", "Setup", "Speedup", "Equality", "Acceptance by depth and rank", "Cost model", "Plots",
                        "Caveats"]
    setup = section(markdown, "Setup")
    for fact in ("- model: tiny (tiny-instruct)", "- data: mini, 4 questions, max_new_tokens 8", "- dtype: float32",
                 "- device: cpu (cpu)", "- threads: 1", "- versions: torch 2.13.0, transformers 5.24.0",
                 "- git commit: 000000000000", "- date: 2025-12-02T10:00:00",
                 "- runs: baseline (run 0), pld (run 0), recycling-paper (runs 0, 1)"):
        assert fact in setup
    plots = section(markdown, "Plots")
    images = re.findall(r"!\[[^]]+\]\((report_files/[^)]+\.png)\)", plots)
    assert images == [f"report_files/{n}.png" for n in ("speedup_by_group", "mat_vs_speedup", "accept_lengths")]
    assert all((folder / p).is_file() for p in images) and data["plots"] == images
    caveats = {c["kind"]: c for c in data["caveats"]}
    assert set(caveats) == {"timed_apart", "errors", "unequal"}  # one baseline run, nothing in turn: no drift
    assert caveats["timed_apart"]["labels"] == ["pld", "recycling-paper"]
    assert caveats["errors"]["questions"] == [321] and "RuntimeError: out of memory" in caveats["errors"]["text"]
    text = section(markdown, "Caveats")
    assert all(f"- {c['text']}" in text for c in data["caveats"])
    assert "timed apart from the baseline" in text and "pld, recycling-paper" in text


def test_methods_in_turn_are_not_timed_apart_and_the_baselines_drift_within_its_run_shows(folder, capsys):
    keep(folder, "baseline-float32-cpu-run0", "pld-float32-cpu-run0", "recycling-paper-float32-cpu-run0")
    labels = ["baseline", "pld", "recycling-paper"]
    for label in labels:
        edit_meta(folder / f"{label}-float32-cpu-run0.meta.json", interleaved_with=[m for m in labels if m != label])
    markdown, data = make_report(folder, capsys)
    kinds = [c["kind"] for c in data["caveats"]]
    assert "timed_apart" not in kinds and "every method was timed in turn" in section(markdown, "Speedup")
    [drift] = [c for c in data["caveats"] if c["kind"] == "drift_within_run"]
    # the baseline answered q81 first at 10 tok/s and q321 last at 6 tok/s: a tenth of 4 questions is 1
    assert (drift["label"], drift["n_questions"]) == ("baseline", 1)
    assert (drift["first_tokens_per_s"], drift["last_tokens_per_s"], drift["ratio"]) == pytest.approx((10, 6, 0.6))
    assert "baseline run 0 ran its last tenth of questions (1) at 0.60x" in section(markdown, "Caveats")
    assert "pld, recycling-paper answered in turn with it" in drift["text"]


def test_a_second_baseline_run_shows_the_drift_between_runs(folder, capsys):
    keep(folder, "baseline-float32-cpu-run0", "recycling-paper-float32-cpu-run0")
    for suffix in (".jsonl", ".meta.json"):
        shutil.copy(folder / f"baseline-float32-cpu-run0{suffix}", folder / f"baseline-float32-cpu-run1{suffix}")
    edit_meta(folder / "baseline-float32-cpu-run1.meta.json", run=1)

    def slower(rec):
        rec["choices"][0]["wall_time"] = [2 * t for t in rec["choices"][0]["wall_time"]]
        return rec

    edit_records(folder / "baseline-float32-cpu-run1.jsonl", slower)
    markdown, data = make_report(folder, capsys)
    [drift] = [c for c in data["caveats"] if c["kind"] == "drift_between_runs"]
    assert (drift["first_run"], drift["last_run"], drift["n_questions"]) == (0, 1, 4)
    assert drift["ratio"] == pytest.approx(0.5) and drift["first_tokens_per_s"] == pytest.approx(6.25)
    assert "baseline run 1 measured 0.50x the tokens/s of its run 0" in section(markdown, "Caveats")
    assert not [c for c in data["caveats"] if c["kind"] == "drift_within_run"]  # nothing answered in turn


def test_plans_policies_and_plan_changes_are_shown(folder, capsys):
    plan = {"buckets": [{"below": 32, "context": 16, "nodes": 30, "widths": [8, 8, 6, 2, 2, 2, 1, 1],
                         "expected_tokens": 5.1, "predicted_speedup": 4.2749, "predicted_tokens_per_s": 5182.607},
                        {"below": None, "context": 64, "nodes": 0, "widths": [], "expected_tokens": 1.0,
                         "predicted_speedup": 1.0, "predicted_tokens_per_s": 100.0}],
            "sources": {"acceptance": "/elsewhere/acceptance-tiny.json", "padded": True}}
    policy = {"buckets": [{"below": None, "context": 16, "by_class": {"0": "aux + chain 8", "1+": "chain 15"},
                           "expected_tokens": 3.625, "predicted_speedup": 3.3964, "predicted_tokens_per_s": 4345.991}]}
    for run in (0, 1):
        edit_meta(folder / f"recycling-paper-float32-cpu-run{run}.meta.json", drafter={"plan": plan})
    edit_meta(folder / "pld-float32-cpu-run0.meta.json", drafter={"policy": policy})
    changes = {81: [{"plan_changes": [{"step": 1}, {"step": 5}]}, {"plan_changes": []}],
               121: [{"plan_changes": [{"step": 3}]}]}

    def with_changes(rec):
        if rec["question_id"] in changes:
            rec["choices"][0]["drafter_stats"] = changes[rec["question_id"]]
        if rec["question_id"] == 81:  # a change while warming up, recorded with the run's first answer
            rec["choices"][0]["warmup_drafter_stats"] = [{"plan_changes": [{"step": 40}]}]
        return rec

    edit_records(folder / "recycling-paper-float32-cpu-run0.jsonl", with_changes)
    markdown, data = make_report(folder, capsys)
    text = section(markdown, "Cost model")
    [(heading, header, cells)] = tables(text)
    assert heading == f"Plans chosen ({SECTION})" and header == list(report.PLAN_COLUMNS)
    assert cells == [["pld", "0", "policy", "all", "match 0: aux + chain 8; match 1+: chain 15", "3.62", "3.40",
                      "4346.0"],
                     ["recycling-paper", "0, 1", "plan", "< 32", "30 nodes, widths 8-8-6-2-2-2-1-1", "5.10", "4.27",
                      "5182.6"],
                     ["recycling-paper", "0, 1", "plan", "≥ 32", "no draft", "1.00", "1.00", "100.0"]]
    assert "recycling-paper plan made from: acceptance acceptance-tiny.json; padded yes" in text
    assert "recycling-paper: 4 plan changes over 2 questions (1 run)" in text
    assert data["plan_changes"] == [{"section": SECTION, "label": "recycling-paper", "changes": 4, "runs": 1,
                                     "questions": 2}]


def test_commands_are_rebuilt_from_the_recorded_configs(folder, capsys):
    """Headers of real runs (their config as evaluation.run records it): the command recomposes the same config."""
    keep(folder, "baseline-float32-cpu-run0", "recycling-paper-float32-cpu-run")
    shared = ["model=smollm2-135m", "data=spec_bench_mini", "max_new_tokens=8", "threads=1"]
    methods = {"baseline": ["method=baseline"], "recycling-paper": ["method=recycling", "method.tree=auto",
                                                                    "method.label=recycling-paper"]}
    for label, overrides in methods.items():
        for path in folder.glob(f"{label}-*.meta.json"):
            recorded = OmegaConf.to_container(config(*shared, *overrides), resolve=True)
            run_config = {**recorded.pop("run"), "id": json.loads(path.read_text())["run"]}
            edit_meta(path, config=recorded, run_config=run_config)
    markdown, data = make_report(folder, capsys)
    assert data["setups"][0]["commands"] == [
        "python -m evaluation.run model=smollm2-135m method=baseline data=spec_bench_mini max_new_tokens=8 threads=1",
        "python -m evaluation.run -m model=smollm2-135m method=recycling data=spec_bench_mini max_new_tokens=8 "
        "method.tree=auto threads=1 method.label=recycling-paper run.id=0,1"]
    # the same runs, answered in turn (evaluation.interleave records whom with): one command, methods in order
    keep(folder, "baseline-float32-cpu-run0", "recycling-paper-float32-cpu-run0")
    edit_meta(folder / "baseline-float32-cpu-run0.meta.json", interleaved_with=["recycling-paper"])
    edit_meta(folder / "recycling-paper-float32-cpu-run0.meta.json", interleaved_with=["baseline"])
    markdown, data = make_report(folder, capsys)
    command = ("python -m evaluation.interleave model=smollm2-135m "
               "'methods=[\"baseline\",\"recycling:tree=auto,label=recycling-paper\"]' data=spec_bench_mini "
               "max_new_tokens=8 threads=1")
    assert data["setups"][0]["commands"] == [command]
    assert f"```sh\n{command}\n```" in section(markdown, "Setup")


def test_out_writes_elsewhere_and_a_rerun_replaces_the_plots(folder, tmp_path, capsys):
    out = tmp_path / "published"
    make_report(folder, capsys, out)
    assert (out / "report.md").is_file() and not (folder / "report.md").exists()
    stale = out / report.FILES_DIR / "from-an-older-report.png"
    stale.write_bytes(b"")
    make_report(folder, capsys, out)
    assert not stale.exists()


def test_the_html_page_is_one_file_without_scripts_or_links(folder, capsys):
    markdown, data = make_report(folder, capsys)
    page = (folder / "report.html").read_text()
    assert "<script" not in page and "<link" not in page
    sources = re.findall(r'\b(?:src|href)="([^"]*)"', page)
    assert len(sources) == len(data["plots"]) and all(s.startswith("data:image/png;base64,") for s in sources)
    assert page.count("<table>") == len(tables(markdown))
    assert "<h2>Caveats</h2>" in page and "2.14 ± 0.20" in page


def test_the_html_page_renders_in_headless_chromium(folder, tmp_path, capsys):
    browser = next((shutil.which(name) for name in BROWSERS if shutil.which(name)), None)
    if browser is None:
        pytest.skip(f"no browser on PATH ({', '.join(BROWSERS)}): install Debian's chromium (apt-get install "
                    "chromium) to check that the HTML report renders")
    make_report(folder, capsys)
    alone = tmp_path / "alone"  # the page without report_files/ beside it: it must need nothing else
    alone.mkdir()
    shutil.copy(folder / "report.html", alone / "report.html")
    shot = tmp_path / "shot.png"
    done = subprocess.run([browser, "--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                           "--window-size=1200,1600", f"--screenshot={shot}", "--enable-logging=stderr", "--v=0",
                           (alone / "report.html").as_uri()], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    console = [line for line in done.stderr.splitlines() if ":CONSOLE" in line or "Uncaught" in line]
    assert console == []  # the page has no script: any console message is an error
    pixels = image.imread(shot)[..., :3].reshape(-1, 3)
    colours = np.unique((pixels * 255).round().astype(np.uint8), axis=0)
    assert len(colours) > 50  # text, tables and plots, not a blank page
    assert (pixels.min(axis=1) < 0.5).mean() > 0.01  # dark pixels: the text


def test_the_summary_is_the_overall_rows_and_the_turns_equal_to_the_baseline(folder, capsys):
    markdown, data = make_report(folder, capsys)
    [(heading, header, cells)] = tables(section(markdown, "Summary"))
    assert heading == SECTION and header[:3] == ["Method", "Speedup", "MAT"]
    overall = [r for r in data["speedup"] if r["group"] == "Overall"]
    assert [c[0] for c in cells] == [r["label"] for r in overall]  # in the speedup table's order
    for line, row in zip(cells, overall):
        assert line[1:5] == [shown(row["speedup"], 2), shown(row["mat"], 2), shown(row["tokens_per_s"], 1),
                             shown(row["decode_speedup"], 2)]
        reports = [e for e in data["equality"] if e["label"] == row["label"]]
        expected = "(the baseline)" if row["reference"] else (
            f"{sum(e['n_identical_turns'] for e in reports)}/{sum(e['n_turns'] for e in reports)}")
        assert line[5] == expected
