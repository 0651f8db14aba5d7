"""Run one method on one question set and write its result file.

    python -m evaluation.run model=smollm2-135m method=recycling data=spec_bench_mini \\
        max_new_tokens=128 dtype=float32 device=cpu run.dir=results

Every method goes through the same :class:`methods.engine.Engine` loop; each question is answered
turn by turn (turn 2 sees turn 1's answer, as in Spec-Bench) and written as one durable record. A
question that fails (a prompt over the context length, out of memory) becomes an error record and
the run goes on. Rerunning the same command resumes where it stopped.

SIGTERM or SLURM's warning signal (USR2) stops a run cleanly (evaluation.signals): the question in flight is
abandoned, the file closed whole, and it exits with status 75 (or submitit requeues it). A job that fails as a
whole leaves ``<result>.failed.json`` beside its file and, in a sweep (``-m``), the other jobs still run;
``python -m evaluation.status RUN_DIR`` says which jobs are done (docs/reliability.md).

With ``batch_size=B`` > 1 the job answers B questions at once (:class:`methods.batch.BatchEngine`, continuous
batching, docs/batching.md): each question is a session that asks for its turns one after another, its record is
written when its last turn ends, and it records the row it ran in and its wall time (``batch``). The run's label and
result file name the batch size (``recycling-paper-k8-hot-b4``).

Under sampling (``sampling.temperature > 0``, docs/sampling.md) every turn's noise is keyed by the seed, the
question id and the turn (:func:`generation_key`), not drawn from a stream: a question's answer is the same
whichever method, order or resumption produced it. The run's label and result file then name the sampling
(``recycling-paper-k8-hot-T0.7-p0.9``). Every record's ``model_id`` names the temperature as Spec-Bench's
answer files do (``smollm2-135m-temp-0.0``).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Callable, Generator, Iterator, NoReturn

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from evaluation import models, signals
from evaluation import data as datasets
from evaluation.build import build
from evaluation.results import ResultFile, ResultLocked, environment, failure_path, write_failure
from evaluation.signals import Stopped
from evaluation.store import StoreError
from methods.batch import BatchEngine, Request, run_batch
from methods.drafter import Drafter, DrafterUnfit
from methods.engine import Engine, Generation
from methods.paths import resolve_path
from methods.sampling import Sampling


def generation_key(question_id: object, turn: int) -> int:
    """The key of a question's turn (with ``sampling.seed``, it keys the noise): a stable hash, the same in every
    process (Python's ``hash`` of a string is salted per process)."""
    return int.from_bytes(hashlib.sha256(f"{question_id}/{turn}".encode()).digest()[:8], "little")


def run_label(cfg: DictConfig) -> str:
    """The method's label, with the sampling settings when it samples (``-T0.7-p0.9``): a sampled run is another
    series than a greedy one of the same method, in its result file's name and in every table."""
    tag = Sampling.of(cfg.get("sampling")).tag()
    label = f"{cfg.method.label}-{tag}" if tag else str(cfg.method.label)
    batch = int(cfg.get("batch_size", 1))
    return f"{label}-b{batch}" if batch > 1 else label


def answer(question: dict, engine: Engine, drafter: Drafter, loaded: models.LoadedModel, template: str,
           max_new_tokens: int) -> dict:
    """One question, turn by turn, as a Spec-Bench-compatible record (plus output_ids and timings)."""
    session = turns(question, loaded.tokenizer, template, max_new_tokens)
    request = next(session)
    while True:
        gen = engine.generate(request.prompt_ids, drafter, request.max_new_tokens, key=request.key)
        try:
            request = session.send(gen)
        except StopIteration as done:
            return done.value


def turns(question: dict, tokenizer: object, template: str, max_new_tokens: int,
          generations: list[Generation] | None = None) -> Generator[Request, Generation, dict]:
    """One question as a session: it asks for its turns one by one (turn 2's prompt holds turn 1's answer) and
    returns its Spec-Bench-compatible record's ``choices``; ``generations`` collects every turn's generation."""
    messages: list[dict[str, str]] = []
    turns: dict[str, list] = {k: [] for k in
                              ("turns", "new_tokens", "wall_time", "decoding_steps", "accept_lengths", "output_ids",
                               "prompt_tokens", "prefill_time", "decode_time", "forward_time", "accept_paths",
                               "block_sizes", "end")}
    for i, turn in enumerate(question["turns"]):
        messages.append({"role": "user", "content": turn})
        prompt = models.prompt_ids(tokenizer, template, messages)
        gen = yield Request(prompt, max_new_tokens, generation_key(question["question_id"], i))
        if generations is not None:
            generations.append(gen)
        text = tokenizer.decode(gen.output_ids, skip_special_tokens=True)
        messages.append({"role": "assistant", "content": text})
        turns["turns"].append(text)
        turns["new_tokens"].append(len(gen.output_ids))
        turns["wall_time"].append(gen.wall_time)
        turns["decoding_steps"].append(gen.decoding_steps)
        turns["output_ids"].append(gen.output_ids)
        turns["prompt_tokens"].append(len(prompt))
        turns["prefill_time"].append(gen.prefill_time)
        turns["decode_time"].append(gen.decode_time)
        turns["forward_time"].append(gen.forward_time)
        # per decode step, flat over turns as Spec-Bench writes accept_lengths
        turns["accept_lengths"].extend(gen.accept_lengths)
        turns["accept_paths"].extend(gen.accept_paths)
        turns["block_sizes"].extend(gen.block_sizes)
        turns["end"].append(gen.end)  # why the turn ended: stop, budget or context
        if gen.drafter_stats:  # a drafter that reports counters reports them for every turn
            turns.setdefault("drafter_stats", []).append(gen.drafter_stats)
    return {"choices": [{"index": 0, **turns}]}


class Job:
    """One method's run, opened: its drafter, engine and result file (locked), warmed up and resumed.

    ``run`` answers a Job's questions one after another; ``evaluation.interleave`` answers several Jobs'
    questions in turn on one loaded model, so that a drift in the machine's speed hits every method alike.
    """

    def __init__(self, cfg: DictConfig, questions: list[dict], loaded: models.LoadedModel | None = None,
                 interleaved_with: tuple[str, ...] = (), command: Sequence[str] = ()):
        if cfg.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be positive, got {cfg.max_new_tokens}")
        if cfg.threads:
            torch.set_num_threads(int(cfg.threads))
        torch.manual_seed(cfg.seed)
        self.cfg = cfg
        self.n_questions = len(questions)
        built = build(cfg, questions, loaded)
        self.loaded, self.engine, self.drafter = built.loaded, built.engine, built.drafter
        self.batch_size = int(cfg.batch_size)
        # B > 1: the batched engine over the same model, choice rule, padding and stop tokens
        self.batch = BatchEngine(self.engine, self.batch_size) if self.batch_size > 1 else None
        self.serving = uuid.uuid4().hex[:12]  # names this start's batched serving in the records (batch.session)
        self.in_flight: dict[object, bool] = {}  # batched: the questions being answered, and whether recorded
        self.on_record: Callable[[dict], None] | None = None  # called after every record a batched serve writes
        device, dtype_name, padding_facts = built.device, built.dtype_name, built.padding

        config = OmegaConf.to_container(cfg, resolve=True)
        header = {
            "model": cfg.model.name,
            "model_id": cfg.model.model_id or cfg.model.get("path") or cfg.model.get("gguf"),
            "model_source": self.loaded.source,
            "method": cfg.method.name,
            "label": run_label(cfg),
            "data": cfg.data.name,
            "dtype": dtype_name,
            "device": device.type,
            "max_new_tokens": cfg.max_new_tokens,
            "batch_size": self.batch_size,
            "question_ids": [q["question_id"] for q in questions],
            "run": cfg.run.id,
            "eos_token_ids": sorted(self.loaded.eos_token_ids),
            "drafter": self.drafter.describe(),
            "padding": padding_facts,
            **environment(device),
            "config": {k: v for k, v in config.items() if k != "run"},
            "run_config": config["run"],
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        if interleaved_with:  # a resumption must keep the schedule: a sequential run would not compare alike
            header["interleaved_with"] = list(interleaved_with)
        if command:  # what evaluation.status prints to resume it
            header["command"] = list(command)
        self.path = result_path(cfg, dtype_name, device)
        self.results = ResultFile(self.path, header, resume=cfg.run.resume)  # holds the file's lock until closed
        try:
            self._start(questions, dtype_name, device)
        except BaseException:
            self.results.close()
            raise
        failure_path(self.path).unlink(missing_ok=True)  # an earlier failure of this job no longer describes it

    def _start(self, questions: list[dict], dtype_name: str, device: torch.device) -> None:
        cfg, drafter = self.cfg, self.drafter
        for note in self.results.notes:
            print(f"draftbench: {note}", file=sys.stderr)
        self.state_path = self.path.with_name(self.path.name.removesuffix(".jsonl") + ".state.pt")
        self.todo = [q for q in questions if q["question_id"] not in self.results.done]
        print(f"draftbench: {run_label(cfg)} on {cfg.model.name} ({dtype_name}, {device}, {torch.get_num_threads()} "
              f"threads), {len(self.todo)}/{len(questions)} questions of {cfg.data.name} -> {self.path}", file=sys.stderr)
        if drafter.describe():
            print(f"draftbench: drafter {json.dumps(drafter.describe())}", file=sys.stderr)
        firsts = ((q, models.prompt_ids(self.loaded.tokenizer, cfg.model.template,
                                        [{"role": "user", "content": q["turns"][0]}])) for q in questions)
        limit = self.engine.max_length or float("inf")
        warm = next(((q, p) for q, p in firsts if len(p) < limit), None)  # the first question whose prompt fits
        self.warmup_stats: list[dict] = []  # the warm-up's plan changes, recorded with the first answer (Job.answer)
        for _ in range(cfg.warmup if self.todo and warm else 0):
            if self.batch is None:
                gen = self.engine.generate(warm[1], drafter, cfg.max_new_tokens,
                                           key=generation_key(warm[0]["question_id"], 0))
                _keep_plan_changes(gen, self.warmup_stats)
            else:  # every row once, in one batch
                request = Request(warm[1], cfg.max_new_tokens, generation_key(warm[0]["question_id"], 0))
                run_batch(self.batch, (_ask(request, self.warmup_stats) for _ in range(self.batch_size)), drafter)
        if self.results.records and drafter.state_dict():
            if self.state_path.exists():
                drafter.load_state_dict(torch.load(self.state_path, map_location=device))
            else:
                print(f"draftbench: warning: {self.state_path.name} is missing, so {run_label(cfg)}'s hot-start state "
                      "restarts here; the questions after the gap are not comparable with an uninterrupted run",
                      file=sys.stderr)

    def answer(self, question: dict) -> dict:
        """Answer ``question``, write its record durably (an error record if it fails) and the hot-start state."""
        cfg = self.cfg
        record = self._record(question)
        try:
            try:
                record |= answer(question, self.engine, self.drafter, self.loaded, cfg.model.template,
                                 cfg.max_new_tokens)
                if self.warmup_stats:  # a plan that changed while warming up: its changes belong to the run
                    record["choices"][0]["warmup_drafter_stats"], self.warmup_stats = self.warmup_stats, []
            except Exception as err:  # noqa: BLE001 -- one failing question must not end the run
                self._failed(record, err)
            self._write(record)
        except Stopped as stop:  # abandoned before its record: the drafter's in-memory state is not saved either
            written = bool(self.results.records) and self.results.records[-1] is record
            stop.locate(self.path, question["question_id"], written, len(self.results.records), self.n_questions)
            raise
        return record

    def serve(self, questions: list[dict]) -> Iterator[int]:
        """Answer ``questions`` ``batch_size`` at a time (B > 1), writing each record when its question ends; a
        generator that yields after every batched step (evaluation.interleave runs several jobs step by step)."""
        try:
            yield from self.batch.serve((self._session(q) for q in questions), self.drafter)
        except Stopped as stop:  # the questions in flight are abandoned: nothing of them is written
            abandoned = [str(q) for q, recorded in self.in_flight.items() if not recorded]
            last = [str(q) for q, recorded in self.in_flight.items() if recorded][-1:]
            stop.locate(self.path, ", ".join(abandoned or last) or "none", not abandoned, len(self.results.records),
                        self.n_questions)
            raise

    def _session(self, question: dict) -> Generator[Request, Generation, None]:
        """One question as the batched engine serves it: its turns, then its record (with its row and wall time)."""
        cfg, qid = self.cfg, question["question_id"]
        self.in_flight[qid] = False
        record = self._record(question)
        generations: list[Generation] = []
        try:
            record |= yield from turns(question, self.loaded.tokenizer, cfg.model.template, cfg.max_new_tokens,
                                       generations)
        except Exception as err:  # noqa: BLE001 -- one failing question must not end the run
            self._failed(record, err)
        if generations:  # on the batched engine's clock: its own work, from the first prefill to the last token
            first, last = generations[0], generations[-1]
            record["batch"] = {"size": self.batch_size, "slot": first.slot, "session": self.serving,
                               "started": first.started, "finished": last.finished,
                               "wall_time": last.finished - first.started}
        self._write(record)
        self.in_flight[qid] = True
        if self.on_record is not None:
            self.on_record(record)

    def _record(self, question: dict) -> dict:
        return {"question_id": question["question_id"], "category": question["category"],
                "answer_id": uuid.uuid4().hex,  # model_id names the temperature, as Spec-Bench's answer files do
                "model_id": f"{self.cfg.model.name}-temp-{float(self.engine.sampling.temperature)}"}

    def _failed(self, record: dict, err: Exception) -> None:
        record["error"] = {"type": type(err).__name__, "message": str(err)}
        tqdm.write(f"draftbench: {run_label(self.cfg)}: question {record['question_id']} failed: "
                   f"{type(err).__name__}: {err}", file=sys.stderr)

    def _write(self, record: dict) -> None:
        """Write ``record`` and the hot-start state it leaves, together or neither."""
        drafter = self.drafter
        record["tstamp"] = time.time()
        with signals.critical():
            self.results.append(record)
            if drafter.state_dict():
                tmp = self.state_path.with_name(self.state_path.name + ".tmp")
                torch.save(drafter.state_dict(), tmp)
                os.replace(tmp, self.state_path)

    def close(self) -> None:
        """Release the result file and print the run's totals."""
        self.results.close()
        _summary(self.results.records, self.path)


def result_path(cfg: DictConfig, dtype_name: str, device: torch.device) -> Path:
    """Where ``cfg``'s result file goes: ``<run.dir>/<model>/<data>/<label>-<dtype>-<device>-run<id>.jsonl`` (the
    label with the sampling settings when it samples: :func:`run_label`)."""
    out_dir = resolve_path(cfg.run.dir) if not Path(cfg.run.dir).is_absolute() else Path(cfg.run.dir)
    name = f"{run_label(cfg)}-{dtype_name}-{device.type}-run{cfg.run.id}.jsonl"
    return out_dir / cfg.model.name / cfg.data.name / name


def planned_path(cfg: DictConfig) -> Path:
    """``result_path`` without taking a device (``cuda:free`` would lock a GPU): where a job that fails before
    opening its file puts its failure marker."""
    device = str(cfg.device)
    kind = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device.split(":")[0])
    try:
        dtype_name = str(models.resolve_dtype(cfg.dtype, kind, cfg.model)).removeprefix("torch.")
    except Exception:  # noqa: BLE001 -- a dtype this machine cannot check is named as written
        dtype_name = str(cfg.dtype)
    return result_path(cfg, dtype_name, kind)


def record_failure(cfg: DictConfig, err: BaseException, command: Sequence[str]) -> Path | None:
    """Write the failure marker of ``cfg``'s job beside its result file; None where the config cannot name it."""
    try:
        path = planned_path(cfg)
        job = {"model": cfg.model.name, "data": cfg.data.name, "label": run_label(cfg), "run": cfg.run.id,
               "command": list(command)}
    except Exception:  # noqa: BLE001 -- the config itself is broken: the error says so without a marker
        return None
    return write_failure(path, err, job)


def run(cfg: DictConfig, command: Sequence[str] = ()) -> Path:
    """Run ``cfg`` and return the path of its result file (``command``: how it was started, for its header).

    SIGTERM or SIGUSR2 stops it cleanly (``evaluation.signals``): the question in flight is abandoned, the file
    closed, and :class:`~evaluation.signals.Stopped` raised; running it again resumes.
    """
    questions = datasets.load(cfg.data)  # before the model: a bad question file fails in a second
    with signals.stop_on_signals():
        job = Job(cfg, questions, command=command)
        try:
            if job.batch is not None:
                with tqdm(total=len(job.todo), desc=run_label(cfg), unit="q", disable=not cfg.run.progress,
                          file=sys.stderr) as bar:
                    job.on_record = lambda record: bar.update()
                    for _ in job.serve(job.todo):
                        pass
                return job.path
            tokens = seconds = 0.0
            bar = tqdm(job.todo, desc=run_label(cfg), unit="q", disable=not cfg.run.progress, file=sys.stderr)
            for question in bar:
                record = job.answer(question)
                if "choices" in record:
                    tokens += sum(record["choices"][0]["new_tokens"])
                    seconds += sum(record["choices"][0]["wall_time"])
                    bar.set_postfix_str(f"{tokens / seconds:.1f} tok/s")
        finally:
            job.close()
    return job.path


def _ask(request: Request, stats: list[dict]) -> Generator[Request, Generation, None]:
    """A session of one request whose answer is not kept (a warm-up); the plan changes it reports are, into
    ``stats`` (a batch's rows share one plan, and each row's report holds the changes since the last row's)."""
    _keep_plan_changes((yield request), stats)


def _keep_plan_changes(gen: Generation, stats: list[dict]) -> None:
    """Keep a warm-up generation's drafter report where its plan changed: the change belongs to the run."""
    if gen.drafter_stats.get("plan_changes"):
        stats.append(gen.drafter_stats)


def _summary(records: list[dict], path: Path) -> None:
    done = [r["choices"][0] for r in records if "choices" in r]
    errors = len(records) - len(done)
    tokens = sum(sum(c["new_tokens"]) for c in done)
    seconds = sum(sum(c["wall_time"]) for c in done)
    steps = [a for c in done for a in c["accept_lengths"]]
    mat = sum(steps) / len(steps) if steps else float("nan")
    spans: dict[str, list[float]] = {}  # batched: per start, its engine's clock at its first prefill and last token
    for batch in (r["batch"] for r in records if "batch" in r):
        span = spans.setdefault(batch["session"], [batch["started"], batch["finished"]])
        span[:] = [min(span[0], batch["started"]), max(span[1], batch["finished"])]
    served = f", {tokens / max(sum(b - a for a, b in spans.values()), 1e-9):.1f} tok/s in all" if spans else ""
    print(f"draftbench: {len(done)} questions, {errors} errors, {tokens:.0f} tokens in {seconds:.1f} s "
          f"({tokens / max(seconds, 1e-9):.1f} tok/s{' per sequence' if spans else ''}{served}), MAT {mat:.2f} -> "
          f"{path}", file=sys.stderr)


# Errors whose message says what to do: a single run prints it alone, without a traceback.
CLEAR_ERRORS = (models.ModelUnavailable, ResultLocked, StoreError, DrafterUnfit, FileNotFoundError)


def fail(err: Exception, markers: Sequence[Path], run_dir: str) -> NoReturn:
    """End a job that failed as a whole. In a sweep (``-m``) the error is raised on, so that Hydra records the
    job as failed and the launcher runs the other jobs (the sweep exits non-zero at its end); a single run
    exits with the message."""
    where = f" (failure recorded in {', '.join(map(str, markers))})" if markers else ""
    if HydraConfig.get().mode == RunMode.MULTIRUN:
        print(f"draftbench: error: {type(err).__name__}: {err}{where}; the sweep's other jobs go on "
              f"(python -m evaluation.status {run_dir} lists them all)", file=sys.stderr, flush=True)
        raise err
    if isinstance(err, CLEAR_ERRORS):
        sys.exit(f"draftbench: error: {err}{where}")
    raise err


@hydra.main(version_base=None, config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    command = ["python", "-m", "evaluation.run", *HydraConfig.get().overrides.task]
    try:
        run(cfg, command)
    except Stopped:  # the message is printed; a launcher's requeue has run
        sys.exit(signals.EXIT_STOPPED)
    except Exception as err:  # noqa: BLE001 -- marked, then raised on (see fail)
        marker = None if isinstance(err, ResultLocked) else record_failure(cfg, err, command)  # another job's file
        fail(err, [marker] if marker else [], cfg.run.dir)


if __name__ == "__main__":
    main()
