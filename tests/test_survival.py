"""Sweeps that survive: a run stopped by SIGTERM or SLURM's warning signal (USR2) leaves no partial record and its
rerun (or submitit's requeue) completes it exactly as an uninterrupted run; a job of a sweep that fails is recorded
while the others run; ``evaluation.status`` says which jobs are done and how to finish the rest.

The scenario functions (``stop_a_run``, ``stop_an_interleaved_run``) also make docs/reliability.md's table:
``python tests/kill_table.py``.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from hydra import initialize_config_dir

from evaluation import signals, speedup, status
from evaluation.interleave import interleave, method_configs
from evaluation.results import meta_path, read_records, write_failure
from evaluation.run import run
from helpers import CONF, PROJECT_ROOT, config, tiny_checkpoint
from test_reliability import questions, records, tiny_args

N_QUESTIONS = 6
TOKENS = 200  # the checkpoint never ends an answer: each question takes tens of milliseconds, long enough to stop in
STOP_MESSAGE = re.compile(r"draftbench: stopped by (SIG\w+) (in|after) question (\S+) .* of (\S+); (\d+) of (\d+) "
                          r"questions recorded; rerun the same command to resume")
INTERLEAVED = ["baseline", "recycling:tree=paper-b3", "pld"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return tiny_checkpoint(tmp_path_factory.mktemp("long"), ends=False)


def lines_whole(path: Path) -> bool:
    """Every line of the file is a complete JSON record (nothing half-written)."""
    raw = path.read_bytes()
    return (not raw or raw.endswith(b"\n")) and len(read_records(path)[0]) == raw.count(b"\n")


def writer(pid: int, path: Path) -> int:
    """The process under ``pid`` (itself included) that holds ``path`` open: where submitit's local executor
    runs the job that writes it."""
    def descendants(p: int) -> list[int]:
        kids = [int(c) for task in Path(f"/proc/{p}/task").iterdir() for c in (task / "children").read_text().split()]
        return [k for kid in kids for k in (kid, *descendants(kid))]

    for p in (pid, *descendants(pid)):
        try:
            if any(os.readlink(fd) == str(path) for fd in Path(f"/proc/{p}/fd").iterdir()):
                return p
        except OSError:  # it ended meanwhile
            continue
    raise AssertionError(f"no process under {pid} holds {path} open")


def interrupt(command: list[str], watch: Path, sig: int, log: Path, after: int = 2, submitit: bool = False) -> int:
    """Start ``command``, send ``sig`` once ``watch`` holds ``after`` records and the next question is under way,
    and return the exit status (stdout and stderr go to ``log``)."""
    with open(log, "w") as out:
        proc = subprocess.Popen(command, cwd=PROJECT_ROOT, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            while not watch.exists() or watch.read_bytes().count(b"\n") < after:
                assert proc.poll() is None, f"finished before the signal:\n{log.read_text()}"
                time.sleep(0.005)
            time.sleep(0.01)  # past the record just seen (and its hot-start state), into the next question
            os.kill(writer(proc.pid, watch) if submitit else proc.pid, sig)
            return proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()


def compare(got: list[Path], want: list[Path]) -> tuple[int, bool]:
    """(questions recorded more than once, whether every output and accept length equals the reference's)."""
    duplicates, equal = 0, True
    for mine, theirs in zip(got, want):
        ids = [r["question_id"] for r in records(mine)]
        duplicates += len(ids) - len(set(ids))
        by_id = {r["question_id"]: r["choices"][0] for r in records(mine)}
        for r in records(theirs):
            choice = by_id.get(r["question_id"])
            equal &= choice is not None and all(choice[k] == r["choices"][0][k]
                                                for k in ("output_ids", "accept_lengths"))
    return duplicates, equal


def stop_a_run(checkpoint: Path, tmp: Path, sig: int, launcher: str | None = None, timeout_min: int = 60,
               methods: str = "recycling") -> dict:
    """``python -m evaluation.run`` (recycling: hot-start state) stopped by ``sig`` in its third question. Without a
    launcher the same command is run again; with ``submitit_local`` submitit requeues the job itself (a sweep of
    ``methods``, recycling's the one stopped)."""
    data = questions(tmp / "q.jsonl", N_QUESTIONS)
    reference = run(config(*tiny_args(checkpoint, data, tmp / "whole", tokens=TOKENS)))
    args = tiny_args(checkpoint, data, tmp / "stopped", tokens=TOKENS)
    target = tmp / "stopped" / reference.relative_to(tmp / "whole")
    sweep = ["-m", f"hydra/launcher={launcher}", f"hydra.launcher.timeout_min={timeout_min}", f"method={methods}"] \
        if launcher else []
    command = [sys.executable, "-m", "evaluation.run", *sweep,
               *(a for a in args if not (sweep and a.startswith("method=")))]
    status_code = interrupt(command, target, sig, tmp / "log", submitit=launcher is not None)
    logs = [tmp / "log", *(tmp / "stopped").glob(".multirun/*/.submitit/*/*_log.*")]
    stops = [m for log in logs for m in STOP_MESSAGE.finditer(log.read_text())]
    assert len(stops) == 1, "\n".join(log.read_text() for log in logs)
    stop = stops[0]
    row = {"signal": stop[1], "how": f"evaluation.run, {launcher or 'no launcher'}", "exit": status_code,
           "when": f"{stop[2]} question {stop[3]}" + (" (recorded)" if stop[2] == "after" else " (abandoned)"),
           "recorded": int(stop[5]), "message_names_file": stop[4] == str(target),
           "whole": lines_whole(target) and not any("dropped a partial" in log.read_text() for log in logs)}
    if launcher:
        row["starts"] = sum(log.read_text().count("Starting with JobEnvironment") for log in logs)
        row["rerun"] = "requeued by submitit"
    else:
        run(config(*args))  # the same command again
        row["rerun"] = "the same command"
    row["duplicates"], row["equal"] = compare([target], [reference])
    row["complete"] = sorted(r["question_id"] for r in records(target)) == list(range(N_QUESTIONS))
    return row


def stop_an_interleaved_run(checkpoint: Path, tmp: Path, sig: int = signal.SIGTERM) -> dict:
    """``python -m evaluation.interleave`` with three methods stopped by ``sig``; rerun with the command that
    ``evaluation.status`` prints."""
    data = questions(tmp / "q.jsonl", N_QUESTIONS)

    def shared(out: Path) -> list[str]:
        return [a for a in tiny_args(checkpoint, data, out, tokens=TOKENS) if not a.startswith("method=")]

    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        references = interleave(method_configs(INTERLEAVED, shared(tmp / "whole")))
    targets = [tmp / "stopped" / p.relative_to(tmp / "whole") for p in references]
    entries = "[" + ",".join(f'"{m}"' for m in INTERLEAVED) + "]"
    command = [sys.executable, "-m", "evaluation.interleave", f"methods={entries}", *shared(tmp / "stopped")]
    status_code = interrupt(command, targets[-1], sig, tmp / "log")
    stop = STOP_MESSAGE.search((tmp / "log").read_text())
    counts = [len(read_records(t)[0]) for t in targets]
    jobs = status.survey(tmp / "stopped")
    rerun = status.rerun_commands([j for j in jobs if j.state != "done"])
    row = {"signal": stop[1], "how": "evaluation.interleave, 3 methods", "exit": status_code,
           "when": f"{stop[2]} question {stop[3]}" + (" (recorded)" if stop[2] == "after" else " (abandoned)"),
           "recorded": "/".join(map(str, counts)), "whole": all(lines_whole(t) for t in targets),
           "message_names_file": stop[4] in map(str, targets), "rerun": "the command evaluation.status prints",
           "states": sorted(j.state for j in jobs), "commands": rerun}
    assert len(rerun) == 1 and not rerun[0].startswith("#"), rerun
    subprocess.run([sys.executable, *shlex.split(rerun[0])[1:]], cwd=PROJECT_ROOT, check=True, capture_output=True)
    row["duplicates"], row["equal"] = compare(targets, references)
    row["complete"] = all(sorted(r["question_id"] for r in records(t)) == list(range(N_QUESTIONS)) for t in targets)
    return row


def assert_survived(row: dict) -> None:
    assert row["exit"] in (signals.EXIT_STOPPED, 0), row  # 0: submitit requeued the job and it then completed
    assert row["whole"] and row["message_names_file"], row
    assert row["complete"] and row["duplicates"] == 0 and row["equal"], row


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR2], ids=["SIGTERM", "SIGUSR2"])
def test_a_stopped_run_leaves_whole_records_and_its_rerun_equals_an_uninterrupted_one(checkpoint, tmp_path, sig):
    row = stop_a_run(checkpoint, tmp_path, sig)
    assert_survived(row)
    assert row["exit"] == signals.EXIT_STOPPED and row["signal"] == signal.Signals(sig).name
    assert 2 <= row["recorded"] < N_QUESTIONS


def test_submitit_requeues_a_job_stopped_by_usr2_and_runs_it_beside_a_failing_one(checkpoint, tmp_path):
    row = stop_a_run(checkpoint, tmp_path, signal.SIGUSR2, launcher="submitit_local", methods="recycling,eagle")
    assert row["whole"] and row["message_names_file"], row
    assert row["complete"] and row["duplicates"] == 0 and row["equal"], row
    assert row["starts"] == 3  # eagle's job, recycling's stopped, then requeued, completed in the same sweep
    assert 2 <= row["recorded"] < N_QUESTIONS
    assert row["exit"] == 1  # the sweep ends saying that eagle failed (no head for this model), with its marker:
    assert list((tmp_path / "stopped").rglob("eagle-*.failed.json"))


def test_a_stopped_interleaved_run_leaves_every_file_whole_and_resumes_them_at_one_question(checkpoint, tmp_path):
    row = stop_an_interleaved_run(checkpoint, tmp_path)
    assert_survived(row)
    assert row["exit"] == signals.EXIT_STOPPED and row["states"] and set(row["states"]) <= {"done", "partial"}
    counts = [int(n) for n in row["recorded"].split("/")]
    assert max(counts) - min(counts) <= 1  # all at the same question: some had answered it, the others had not
    assert "evaluation.interleave" in row["commands"][0] and "methods=" in row["commands"][0]


def in_main_thread() -> None:
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers are installed in the main thread only")


def test_a_signal_during_the_record_write_is_held_until_the_record_and_state_are_written(checkpoint, tmp_path,
                                                                                       monkeypatch):
    in_main_thread()
    from evaluation.results import ResultFile

    data = questions(tmp_path / "q.jsonl", 4)
    args = tiny_args(checkpoint, data, tmp_path / "out", tokens=40)
    reference = run(config(*tiny_args(checkpoint, data, tmp_path / "whole", tokens=40)))
    append = ResultFile.append

    def append_then_signal(self, record):  # a SIGTERM arrives while question 1's record is written
        if record["question_id"] == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        append(self, record)

    monkeypatch.setattr(ResultFile, "append", append_then_signal)
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(signals.Stopped) as stop:
        run(config(*args))
    assert "after question 1 (recorded)" in stop.value.message() and "2 of 4 questions recorded" in stop.value.message()
    assert signal.getsignal(signal.SIGTERM) == before  # the handlers are put back
    monkeypatch.undo()
    path = run(config(*args))
    assert compare([path], [reference]) == (0, True)  # the state saved with question 1 was the one after it


def test_a_signal_mid_question_abandons_it_and_its_state(checkpoint, tmp_path, monkeypatch):
    in_main_thread()
    from methods.engine import Engine

    data = questions(tmp_path / "q.jsonl", 4)
    args = tiny_args(checkpoint, data, tmp_path / "out", tokens=40)
    reference = run(config(*tiny_args(checkpoint, data, tmp_path / "whole", tokens=40)))
    generate, calls = Engine.generate, []

    def generate_then_signal(self, *a, **k):  # the 4th generation (warmup, q0, q1, then q2) is interrupted
        calls.append(1)
        if len(calls) == 4:
            os.kill(os.getpid(), signal.SIGUSR2)
        return generate(self, *a, **k)

    monkeypatch.setattr(Engine, "generate", generate_then_signal)
    with pytest.raises(signals.Stopped, match="SIGUSR2") as stop:
        run(config(*args))
    assert "in question 2 (abandoned, nothing of it written)" in stop.value.message()
    monkeypatch.undo()
    path = run(config(*args))
    assert compare([path], [reference]) == (0, True)  # the drafter state it had half-updated was not kept


def sweep(checkpoint: Path, data: Path, out: Path, methods: str, *extra: str) -> subprocess.CompletedProcess:
    args = [a for a in tiny_args(checkpoint, data, out, tokens=8) if not a.startswith("method=")]
    command = [sys.executable, "-m", "evaluation.run", "-m", f"method={methods}", *args, "warmup=0", *extra]
    return subprocess.run(command, cwd=PROJECT_ROOT, capture_output=True, text=True)


def test_a_failing_job_is_recorded_and_the_sweep_goes_on(tmp_path, capsys, launcher="basic"):
    checkpoint = tiny_checkpoint(tmp_path / "tiny", max_positions=96)
    data = questions(tmp_path / "q.jsonl", 2)
    out = tmp_path / "out"
    # eagle fails at run time on a model whose config names no EAGLE head (as on a node without the model)
    proc = sweep(checkpoint, data, out, "baseline,eagle,pld", f"hydra/launcher={launcher}")
    assert proc.returncode != 0  # the sweep says it was not all done, at its end
    folder = out / "hf" / "spec_bench_mini"
    for label in ("baseline", "pld-n1-3-k10"):  # the job after the failing one ran too
        assert [r["question_id"] for r in records(folder / f"{label}-float32-cpu-run0.jsonl")] == [0, 1]
    marker = json.loads((folder / "eagle-paper-b2-n60-d6-k10-float32-cpu-run0.failed.json").read_text())
    assert marker["error"]["type"] == "HeadError" and "method=eagle" in marker["command"]
    assert "HeadError" in marker["error"]["traceback"]

    assert status.main([str(out)]) == 1
    text = capsys.readouterr().out
    assert re.search(r"failed +eagle-paper-b2-n60-d6-k10 run0 +HeadError: method.head is not set", text)
    assert len(re.findall(r"done +(baseline|pld-n1-3-k10) run0 +2 of 2 questions", text)) == 2
    rerun = text.split("not done (each resumes after its last complete record):\n")[1].strip().splitlines()
    assert len(rerun) == 1 and "method=eagle " in rerun[0] and " -m " in rerun[0]
    assert f"hydra/launcher={launcher}" in rerun[0]

    assert speedup.main([str(out), "--json", "--out", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    assert {r["label"] for r in json.loads(captured.out)} == {"baseline", "pld-n1-3-k10"}
    assert "failed   eagle-paper-b2-n60-d6-k10 run0  HeadError" in captured.err


def test_a_bad_override_is_refused_before_any_job_starts(tmp_path):
    data = questions(tmp_path / "q.jsonl", 2)
    proc = sweep(tmp_path / "nowhere", data, tmp_path / "out", "baseline,pld", "method.no_such_key=1")
    assert proc.returncode != 0 and "no_such_key" in proc.stderr
    assert not list((tmp_path / "out").rglob("*.jsonl")) and not list((tmp_path / "out").rglob("*.failed.json"))


def test_status_names_done_partial_failed_and_missing_jobs_and_the_command_that_finishes_them(tmp_path, capsys):
    checkpoint = tiny_checkpoint(tmp_path / "tiny", max_positions=96)
    data = questions(tmp_path / "q.jsonl", 3)
    out = tmp_path / "out"
    assert sweep(checkpoint, data, out, "baseline,pld,recycling,lookahead").returncode == 0
    folder = out / "hf" / "spec_bench_mini"
    files = {label: folder / f"{label}-float32-cpu-run0.jsonl" for label in
             ("baseline", "pld-n1-3-k10", "recycling-paper-k8-hot", "lookahead-N5-W7-G7-one-promptFalse")}
    done = files["baseline"].read_bytes(), meta_path(files["baseline"]).read_bytes()
    partial = files["pld-n1-3-k10"]
    partial.write_text(partial.read_text().splitlines(keepends=True)[0])  # stopped after its first question
    failed = files["recycling-paper-k8-hot"]
    failed.write_text("")  # failed (out of memory, say) before its first answer
    header = json.loads(meta_path(failed).read_text())
    write_failure(failed, MemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore detail"),
                  {k: header[k] for k in ("model", "data", "label", "run", "command")})
    for path in folder.glob("lookahead-*"):  # never started
        path.unlink()

    assert status.main([str(out)]) == 1
    text = capsys.readouterr().out
    assert re.search(r"done +baseline run0 +3 of 3 questions", text)
    assert re.search(r"partial +pld-n1-3-k10 run0 +1 of 3 questions", text)
    assert re.search(r"failed +recycling-paper-k8-hot run0 +MemoryError: CUDA out of memory. Tried to allocate "
                     r"2.00 GiB \[0 of 3 questions\]", text)
    assert re.search(r"missing +lookahead-N5-W7-G7-one-promptFalse run0 +no result file \(method=lookahead\)", text)
    assert "1 done, 1 partial, 1 failed, 1 missing of 4 jobs" in text
    commands = text.split("not done (each resumes after its last complete record):\n")[1].strip().splitlines()
    assert len(commands) == 1 and " method=pld,recycling,lookahead " in commands[0]  # one box: those three jobs

    subprocess.run([sys.executable, *shlex.split(commands[0])[1:]], cwd=PROJECT_ROOT, check=True, capture_output=True)
    assert status.main([str(out)]) == 0
    assert "4 done of 4 jobs" in capsys.readouterr().out
    assert not list(folder.glob("*.failed.json"))  # the rerun that started the failed job removed its marker
    assert (files["baseline"].read_bytes(), meta_path(files["baseline"]).read_bytes()) == done  # not even reopened
    assert [r["question_id"] for r in records(partial)] == [0, 1, 2]


def test_rerun_boxes_cover_exactly_the_unfinished_jobs():
    grid = [(("method", m), ("run.id", r)) for m in ("a", "b", "c") for r in ("0", "1", "2")]
    for unfinished in (grid, grid[:1], [g for g in grid if g[0][1] != "b"], [grid[0], grid[4], grid[8]],
                       [g for g in grid if g[1][1] == "2" or g[0][1] == "a"]):
        boxes = status._boxes(list(unfinished))
        covered = [tuple(zip([k for k, _ in box], values)) for box in boxes
                   for values in itertools.product(*(v for _, v in box))]
        assert sorted(covered) == sorted(unfinished)  # every unfinished job once, no done job
    assert status._boxes(grid) == [[("method", ["a", "b", "c"]), ("run.id", ["0", "1", "2"])]]


def test_an_empty_result_file_is_left_out_of_the_table_and_named(tmp_path, capsys):
    fixtures = Path(__file__).parent / "fixtures" / "analysis" / "results" / "tiny" / "mini"
    folder = tmp_path / "tiny" / "mini"
    shutil.copytree(fixtures, folder)
    (folder / "pld-float32-cpu-run0.jsonl").write_text("")  # stopped before its first answer
    assert speedup.main([str(tmp_path), "--out", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "pld" not in text.split("jobs not done")[0]
    assert re.search(r"partial +pld run0 +0 of 4 questions", text)


def test_a_partial_run_is_marked_and_compared_on_its_questions_only(capsys, tmp_path):
    fixtures = Path(__file__).parent / "fixtures" / "analysis" / "results"
    assert speedup.main([str(fixtures), "--out", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert re.search(r"^pld‡ +Overall +1 +3 ", text, re.M)  # q161 is missing: 3 questions compared
    assert "‡ partial, compared on the questions it answered only" in text and "pld run0 (3 of 4 questions)" in text
    assert re.search(r"partial +pld run0 +3 of 4 questions", text)
