"""Result files into pandas, baseline matching with a provenance check, and the speedup math.

Shared by ``evaluation.speedup``, ``evaluation.equal``, ``evaluation.plots`` and the notebook, so
that every view of a benchmark uses the same definitions (see ``DEFINITIONS``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import pandas as pd

from evaluation.categories import MT_BENCH, OVERALL, group_of, group_order

DEFINITIONS = """\
definitions (per category group and method; only questions without error in both the run and
its baseline count):
  tokens/s of a question = sum over turns of new tokens / sum over turns of wall time
      (new tokens = len(output_ids) on both sides when the file has them, else its new_tokens)
  speedup (--ratio mean, Spec-Bench's definition)
      = mean over questions of method tokens/s / mean over questions of baseline tokens/s
  speedup (--ratio total) = (total new tokens / total wall time) of method / same of baseline
  decode tokens/s and decode speedup: the same with (new tokens - 1) per turn and decode time
      (each turn's first token comes from the prefill forward); prefill ms = prefill time per turn
  MAT (mean accepted tokens) = mean of accept_lengths over all decode forwards (bonus included)
  batch size B > 1 (batch_size=B, several questions at once): tokens/s above is per sequence (what a
      user waits for); total tokens/s = all new tokens / the run's serving time (the batched engine's
      own seconds from its first prefill to its last token, summed over the run's starts; at B = 1 the
      sum of wall times), what the machine serves; a run is paired only with a baseline of its B
  several runs of a label: mean +/- sample std over runs; several baseline runs: the baseline
      value is the mean over its runs; N = questions compared (fewest over runs), Err = failed
      questions (summed over runs)
  a partial run (fewer records than its header's question_ids: stopped, or still running) is
      compared on the questions it answered, with its baseline on the same questions, and marked
      "‡" with its count; the jobs that are partial, failed or missing are named under the table
baseline: by default the run(s) of method "baseline" with the same model, dtype, device, device name
(GPU or CPU model), torch threads, torch and transformers versions, data, max_new_tokens, question
ids, sampling settings (temperature, top_k, top_p, seed; a header without them decoded greedily) and
batch size (a header without it: 1).
A run without such a baseline is refused, naming the keys that differ from the nearest one;
--force compares with that nearest one. A key that an older run header lacks is unknown: it does not
refuse the pair, and the row is marked "*" naming it. --baseline PATH names the
baseline for every run (provenance is still checked). Files without a .meta.json sidecar (e.g.
Spec-Bench answer files) have unknown provenance: they are compared only with a baseline named by
--baseline, or with --force when the inputs hold a single baseline; their rows are marked "*"."""

# A speedup is only meaningful against a baseline measured on the same hardware and software.
PROVENANCE_KEYS = ("model", "dtype", "device", "device_name", "torch_threads", "versions.torch",
                   "versions.transformers", "data", "max_new_tokens", "question_ids", "config.sampling.temperature",
                   "config.sampling.top_k", "config.sampling.top_p", "config.sampling.seed", "batch_size")
# The choice rule's settings (methods.sampling) and the values a header without them decoded with: greedy decoding,
# under which the others do not matter.
SAMPLING_DEFAULTS = {"config.sampling.temperature": 0.0, "config.sampling.top_k": 0, "config.sampling.top_p": 1.0,
                     "config.sampling.seed": 0}
SETUP_KEYS = ("model", "data", "dtype", "device")
RATIOS = ("mean", "total")
UNKNOWN = "?"
CHECKED = "checked"
NOT_CHECKED = "not checked (no .meta.json)"

# Per question, summed over turns; NaN where the record is an error or a Spec-Bench file lacks the field.
COLUMNS = ("category", "group", "error", "context_turns", "n_turns", "tokens", "wall_time", "decode_tokens", "decode_time",
           "prefill_time", "forward_time", "accept_sum", "accept_steps", "accept_lengths", "steps", "sources",
           "plan_changes", "output_ids", "turns", "batch_slot", "batch_session", "batch_started", "batch_finished")

# Spec-Bench's question.jsonl: 81-160 MT-bench (ten per category, in MT_BENCH order), then 80 per task.
_SPEC_BENCH_TASKS = ("translation", "summarization", "qa", "math_reasoning", "rag")


class ResultError(ValueError):
    """Inputs that cannot be read or compared; the message says what was wrong and what to do."""


class ProvenanceError(ResultError):
    """A run and its baseline were produced under different settings."""


@dataclass(frozen=True, eq=False)
class Run:
    """One result file: its sidecar header (None for Spec-Bench/foreign files) and one row per question."""

    path: Path
    meta: dict | None
    frame: pd.DataFrame  # indexed by question_id, with the COLUMNS

    @property
    def foreign(self) -> bool:
        return self.meta is None

    @property
    def label(self) -> str:
        return self.path.stem if self.meta is None else str(self.meta.get("label") or self.meta["method"])

    @property
    def method(self) -> str:
        return self.path.stem if self.meta is None else str(self.meta["method"])

    @property
    def index(self) -> int:
        return 0 if self.meta is None else int(self.meta.get("run", 0))

    @property
    def batch_size(self) -> int:
        """Questions decoded at once (1 for a header without it, and for foreign files)."""
        return int((self.meta or {}).get("batch_size", 1))

    @property
    def series(self) -> str:
        """The label without its batch size (``-b4``): what one line of a plot against the batch size follows."""
        return self.label.removesuffix(f"-b{self.batch_size}") if self.batch_size > 1 else self.label

    @property
    def setup(self) -> tuple[str, ...] | None:
        return None if self.meta is None else tuple(str(self.meta.get(k, UNKNOWN)) for k in SETUP_KEYS)

    @property
    def ok_ids(self) -> pd.Index:
        return self.frame.index[self.frame["error"].isna()]

    @property
    def partial(self) -> str:
        """"<label> run<i> (n of N questions)" where the run recorded fewer questions than its header's
        question_ids (stopped, or still running), else ""."""
        expected = set((self.meta or {}).get("question_ids") or ())
        recorded = len(expected.intersection(self.frame.index))
        if recorded == len(expected):
            return ""
        return f"{self.label} run{self.index} ({recorded} of {len(expected)} questions)"

    @property
    def platform(self) -> str | None:
        """"device name, threads N, torch X, transformers Y" ("?" where the header lacks one); None for foreign files."""
        if self.meta is None:
            return None
        values = [_provenance_value(self.meta, k) for k in ("device_name", "torch_threads", "versions.torch",
                                                             "versions.transformers")]
        name, threads, torch_version, transformers_version = (UNKNOWN if v is None else v for v in values)
        return f"{name}, threads {threads}, torch {torch_version}, transformers {transformers_version}"


@dataclass(frozen=True, eq=False)
class Comparison:
    """A run paired with the baseline run(s) it is measured against."""

    run: Run
    baselines: tuple[Run, ...]
    provenance: str  # CHECKED, NOT_CHECKED, or "forced: differs in ..."

    @property
    def reference(self) -> Run:
        """The baseline run output ids are compared with (the lowest-numbered run)."""
        return min(self.baselines, key=lambda b: (b.index, str(b.path)))

    @property
    def is_reference(self) -> bool:
        """True for the baseline's own runs (their speedup only shows run-to-run noise)."""
        return any(self.run is b for b in self.baselines)

    @property
    def in_turn(self) -> bool:
        """Whether the run was timed question by question in turn with every baseline run (evaluation.interleave),
        so that a drift in the machine's speed hit both alike."""
        mine = set((self.run.meta or {}).get("interleaved_with", ()))
        return all(b.label in mine and b.index == self.run.index for b in self.baselines)

    @property
    def setup(self) -> tuple[str, ...]:
        """The run's setup, or its baseline's for a foreign file."""
        for run in (self.run, *self.baselines):
            if run.setup is not None:
                return run.setup
        return (UNKNOWN,) * len(SETUP_KEYS)

    @property
    def platform(self) -> str:
        """The run's hardware and software, or its baseline's for a foreign file."""
        return next((r.platform for r in (self.run, *self.baselines) if r.platform is not None), UNKNOWN)


def spec_bench_category(question_id: int) -> str:
    """The category of a Spec-Bench question id (for answer files that do not record it)."""
    if 81 <= question_id <= 160:
        return MT_BENCH[(question_id - 81) // 10]
    if 161 <= question_id <= 560:
        return _SPEC_BENCH_TASKS[(question_id - 161) // 80]
    return "unknown"


def load_categories(path: str | Path) -> dict[int, str]:
    """question_id -> category from a question file (Spec-Bench's question.jsonl schema)."""
    return {int(rec["question_id"]): str(rec["category"]) for _, rec in _read_jsonl(Path(path)) if "category" in rec}


def _read_jsonl(path: Path) -> Iterable[tuple[int, dict]]:
    with path.open(encoding="utf-8") as handle:
        for lineno, line in enumerate(handle, 1):
            if line.strip():
                try:
                    yield lineno, json.loads(line)
                except json.JSONDecodeError as err:
                    raise ResultError(f"{path}:{lineno}: not valid JSON ({err}); is the file truncated?") from err


def _error_text(error: object) -> str:
    if isinstance(error, dict):
        return f"{error.get('type', 'Error')}: {error.get('message', '')}"
    return str(error)


def _question_row(rec: dict, categories: dict[int, str]) -> dict:
    """One question's per-turn fields summed over turns (NaN where a Spec-Bench file lacks them)."""
    qid = int(rec["question_id"])
    category = rec.get("category") or categories.get(qid) or spec_bench_category(qid)
    row = {"question_id": qid, "category": category, "group": group_of(category), "error": None}
    if "choices" not in rec:
        if "error" not in rec:
            raise KeyError("choices")
        return {**row, "error": _error_text(rec["error"])}
    choice = rec["choices"][0]
    batch = rec.get("batch") or {}
    row |= {"batch_slot": batch.get("slot"), "batch_session": batch.get("session"),
            "batch_started": batch.get("started", math.nan), "batch_finished": batch.get("finished", math.nan)}
    ids = choice.get("output_ids")
    tokens = [len(turn) for turn in ids] if ids is not None else list(choice["new_tokens"])
    accepts = choice.get("accept_lengths")
    nan = math.nan
    return {
        **row,
        "n_turns": len(tokens),
        "tokens": sum(tokens),
        "wall_time": sum(choice["wall_time"]),
        "decode_tokens": sum(max(n - 1, 0) for n in tokens),
        "decode_time": sum(choice["decode_time"]) if "decode_time" in choice else nan,
        "prefill_time": sum(choice["prefill_time"]) if "prefill_time" in choice else nan,
        "forward_time": nan if None in choice.get("forward_time", [None]) else sum(choice["forward_time"]),
        "accept_sum": sum(accepts) if accepts else nan,
        "accept_steps": len(accepts) if accepts else nan,
        "accept_lengths": list(accepts or []),
        "steps": step_records(choice),
        "context_turns": sum(end == "context" for end in choice.get("end", [])),
        "sources": draft_sources(choice),
        "plan_changes": plan_changes(choice),
        "output_ids": ids,
        "turns": list(choice.get("turns", [])),
    }


def draft_sources(choice: dict) -> dict[str, int]:
    """Decode steps by what was verified (``drafter_stats[].sources``, e.g. SAM's retrieval/aux), summed over turns."""
    total: dict[str, int] = {}
    for stats in choice.get("drafter_stats", []):
        for source, n in stats.get("sources", {}).items():
            total[source] = total.get(source, 0) + n
    return total


def plan_changes(choice: dict) -> float:
    """How often the drafter changed its plan (``drafter_stats[].plan_changes``), summed over turns and the
    warm-up recorded with the run's first answer; NaN where no turn records it (a drafter without a plan, or a
    file written before the field)."""
    counts = [len(stats["plan_changes"]) for stats in choice.get("drafter_stats", []) + choice.get(
        "warmup_drafter_stats", []) if "plan_changes" in stats]
    return float(sum(counts)) if counts else math.nan


def step_records(choice: dict) -> list[tuple[int, int, list[int]]]:
    """``(context length, tokens verified, accepted ranks)`` per decode step; empty for older files."""
    paths, sizes, prompts = choice.get("accept_paths"), choice.get("block_sizes"), choice.get("prompt_tokens")
    if paths is None or sizes is None or prompts is None:
        return []
    lengths, out, i = choice["accept_lengths"], [], 0
    for prompt, n in zip(prompts, choice["decoding_steps"]):
        context = prompt + 1  # the prefill emitted the first token
        for j in range(i, i + n):
            out.append((context, sizes[j], paths[j]))
            context += lengths[j]
        i += n
    return out


def load_run(path: str | Path, categories: dict[int, str] | None = None) -> Run:
    """Read a result file and its ``.meta.json`` sidecar; a later record of a question replaces an earlier one."""
    path = Path(path)
    sidecar = path.with_name(path.stem + ".meta.json")
    try:
        meta = json.loads(sidecar.read_text(encoding="utf-8")) if sidecar.is_file() else None
    except json.JSONDecodeError as err:
        raise ResultError(f"{sidecar}: not valid JSON ({err}); restore it or rerun that benchmark") from err
    rows: dict[int, dict] = {}
    for lineno, rec in _read_jsonl(path):
        try:
            row = _question_row(rec, categories or {})
        except (KeyError, TypeError, IndexError) as err:
            raise ResultError(
                f"{path}:{lineno}: missing or malformed field {err}; expected a draftbench result or a "
                "Spec-Bench answer record (question_id, choices[0] with new_tokens and wall_time)"
            ) from err
        rows[row["question_id"]] = row
    if not rows:
        raise ResultError(f"{path} holds no records; delete it or rerun that benchmark")
    frame = pd.DataFrame(list(rows.values()), columns=["question_id", *COLUMNS]).set_index("question_id")
    return Run(path=path, meta=meta, frame=frame)


def find_result_files(paths: Sequence[str | Path]) -> list[Path]:
    """The ``*.jsonl`` files named or found (recursively) under the folders named."""
    files: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            found = sorted(path.rglob("*.jsonl"))
            if not found:
                raise ResultError(f"no result files (*.jsonl) under {path}; run the benchmark first")
            files += found
        elif path.is_file():
            files.append(path)
        else:
            raise ResultError(f"{path}: no such file or folder")
    return list(dict.fromkeys(files))


def load_runs(paths: Sequence[str | Path], categories: dict[int, str] | None = None) -> list[Run]:
    """Every result file under ``paths``, but those that hold no record yet beside their run header (a run
    stopped before its first answer: ``evaluation.status`` and the speedup table's notes name it)."""
    files = find_result_files(paths)
    return [load_run(path, categories) for path in files
            if path.stat().st_size or not path.with_name(path.stem + ".meta.json").is_file()]


def _provenance_value(meta: dict, key: str) -> object:
    """The header's value at a dotted key (``versions.torch``); None where the header lacks it (the sampling keys:
    their greedy values, see SAMPLING_DEFAULTS)."""
    if key == "batch_size":
        return int(meta.get("batch_size", 1))
    if key in SAMPLING_DEFAULTS:
        sampling = (meta.get("config") or {}).get("sampling") or {}
        if not sampling.get("temperature"):
            return SAMPLING_DEFAULTS[key]
        return sampling.get(key.rsplit(".", 1)[1], SAMPLING_DEFAULTS[key])
    value: object = meta
    for part in key.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return frozenset(value or ()) if key == "question_ids" else value


def provenance_diff(meta: dict, base: dict) -> list[str]:
    """Human-readable differences between two run headers on PROVENANCE_KEYS (empty: comparable).

    A key either header lacks is unknown, not a difference (see ``unknown_provenance``).
    """
    diffs = []
    for key in PROVENANCE_KEYS:
        mine, theirs = _provenance_value(meta, key), _provenance_value(base, key)
        if mine == theirs or mine is None or theirs is None:
            continue
        if key == "question_ids":
            odd = sorted(mine ^ theirs)
            diffs.append(f"question_ids ({len(mine)} vs {len(theirs)} questions; e.g. {', '.join(map(str, odd[:5]))})")
        else:
            diffs.append(f"{key} ({mine} vs {theirs})")
    return diffs


def unknown_provenance(meta: dict, base: dict) -> list[str]:
    """PROVENANCE_KEYS that either header lacks (written before draftbench recorded them)."""
    return [k for k in PROVENANCE_KEYS if _provenance_value(meta, k) is None or _provenance_value(base, k) is None]


def batch1_references(comparisons: Sequence[Comparison]) -> dict[int, Run]:
    """For every run of batch size > 1 (by ``id``): the reference run of a batch-1 baseline among ``comparisons`` whose
    provenance is the same but for the batch size. What its every row must equal (evaluation.equal)."""
    def key(meta: dict) -> tuple:
        return tuple(_provenance_value(meta, k) for k in PROVENANCE_KEYS if k != "batch_size")

    singles: dict[tuple, Run] = {}
    for c in comparisons:
        if c.is_reference and c.run is c.reference and c.run.batch_size == 1 and c.run.meta:
            singles.setdefault(key(c.run.meta), c.run)
    return {id(c.run): singles[key(c.run.meta)] for c in comparisons
            if c.run.batch_size > 1 and c.run.meta and key(c.run.meta) in singles}


def _checked(run: Run, baselines: Sequence[Run]) -> str:
    """CHECKED, or what could not be checked because an older header lacks it."""
    unknown = sorted({k for b in baselines for k in unknown_provenance(run.meta, b.meta)})
    return f"checked except {', '.join(unknown)} (unknown: not in an older .meta.json)" if unknown else CHECKED


def _refusal(run: Run, base: Run, diffs: list[str]) -> ProvenanceError:
    return ProvenanceError(
        f"refusing to compare {run.path} with baseline {base.path}: they differ in {'; '.join(diffs)}. "
        "Run the baseline with the same settings, name another with --baseline PATH, or pass --force."
    )


def _named_pairs(runs: list[Run], baselines: list[Run], force: bool) -> list[Comparison]:
    labels = {b.label for b in baselines}
    if len(labels) > 1:
        raise ResultError(f"--baseline names runs of several labels ({', '.join(sorted(labels))}); "
                          "name the runs of one label")
    named = {b.path.resolve() for b in baselines}
    pairs = []
    for run in [*baselines, *(r for r in runs if r.path.resolve() not in named)]:
        if run.foreign or any(b.foreign for b in baselines):
            pairs.append(Comparison(run, tuple(baselines), NOT_CHECKED))
            continue
        diffs = sorted({d for b in baselines for d in provenance_diff(run.meta, b.meta)})
        if diffs and not force:
            raise _refusal(run, next(b for b in baselines if provenance_diff(run.meta, b.meta)), diffs)
        pairs.append(Comparison(run, tuple(baselines),
                                f"forced: differs in {'; '.join(diffs)}" if diffs else _checked(run, baselines)))
    return pairs


def _auto_pairs(runs: list[Run], force: bool) -> tuple[list[Comparison], list[str]]:
    series: dict[tuple, list[Run]] = {}  # baseline runs grouped by (provenance, label)
    for run in runs:
        if not run.foreign and run.method == "baseline":
            key = (tuple(_provenance_value(run.meta, k) for k in PROVENANCE_KEYS), run.label)
            series.setdefault(key, []).append(run)
    pairs, notes = [], []
    for run in runs:
        if run.foreign:
            if not force:
                notes.append(f"skipped {run.path}: no .meta.json sidecar (a Spec-Bench or foreign file); "
                             "name its baseline with --baseline PATH, or pass --force")
            elif len(series) == 1:
                pairs.append(Comparison(run, tuple(next(iter(series.values()))), NOT_CHECKED))
            else:
                raise ResultError(f"cannot choose a baseline for {run.path} (no .meta.json sidecar) among "
                                  f"{len(series)} baselines; name one with --baseline PATH")
            continue
        if not series:
            raise ResultError(f"no baseline run (method 'baseline') among the inputs for {run.path}; run the "
                              "baseline with the same model, dtype, device, data and max_new_tokens, or name one "
                              "with --baseline PATH")
        exact = [runs_ for runs_ in series.values() if not provenance_diff(run.meta, runs_[0].meta)]
        if len(exact) > 1:
            raise ResultError(f"several baselines match {run.path} ({', '.join(s[0].label for s in exact)}); "
                              "name one with --baseline PATH")
        if exact:
            pairs.append(Comparison(run, tuple(exact[0]), _checked(run, exact[0])))
            continue
        nearest = min(series.values(), key=lambda s: (len(provenance_diff(run.meta, s[0].meta)), str(s[0].path)))
        diffs = provenance_diff(run.meta, nearest[0].meta)
        if not force:
            raise _refusal(run, nearest[0], diffs)
        pairs.append(Comparison(run, tuple(nearest), f"forced: differs in {'; '.join(diffs)}"))
    return pairs, notes


def pair_runs(
    runs: list[Run], baselines: list[Run] | None = None, force: bool = False
) -> tuple[list[Comparison], list[str]]:
    """Pair each run with its baseline; returns the comparisons and notes on skipped files.

    Without ``baselines``, a run's baseline is the run(s) of method "baseline" with the same
    PROVENANCE_KEYS (model, dtype, device and its name, threads, versions, data, ...). If none matches exactly, the nearest
    baseline is used with ``force`` and refused (ProvenanceError) otherwise. Named ``baselines``
    are used for every run, still refusing differing provenance unless ``force``. The baseline's
    own runs are included, paired with themselves.
    """
    if baselines:
        return _named_pairs(runs, baselines, force), []
    return _auto_pairs(runs, force)


def _div(num: float, den: float) -> float:
    return num / den if den > 0 else math.nan


def rates(frame: pd.DataFrame, ratio: str = "mean") -> dict[str, float]:
    """tokens/s, decode tokens/s, prefill ms per turn and MAT of a set of questions (see DEFINITIONS)."""
    if ratio not in RATIOS:
        raise ValueError(f"ratio={ratio!r}: use one of {RATIOS}")
    if frame.empty:
        return dict.fromkeys(("tokens_per_s", "decode_tokens_per_s", "prefill_ms", "mat"), math.nan)
    full = len(frame)  # sums are NaN unless every question has the field (Spec-Bench files lack some)

    def total(column: str) -> float:
        return frame[column].sum(min_count=full)

    if ratio == "mean":
        tokens_per_s = (frame["tokens"] / frame["wall_time"].where(frame["wall_time"] > 0)).mean()
        decode = (frame["decode_tokens"] / frame["decode_time"].where(frame["decode_time"] > 0)).mean()
    else:
        tokens_per_s = _div(total("tokens"), total("wall_time"))
        decode = _div(total("decode_tokens"), total("decode_time"))
    return {
        "tokens_per_s": float(tokens_per_s),
        "decode_tokens_per_s": float(decode),
        "prefill_ms": 1000 * _div(total("prefill_time"), total("n_turns")),
        "mat": _div(total("accept_sum"), total("accept_steps")),
    }


def serving_seconds(frame: pd.DataFrame) -> float:
    """The time a run took to serve ``frame``'s questions: per batched start (``batch_session``), its engine's clock
    from the first prefill to the last token, summed over starts; the sum of wall times where questions were
    answered one at a time."""
    batched = frame["batch_session"].notna()
    spans = frame.loc[batched].groupby("batch_session").agg(start=("batch_started", "min"),
                                                            end=("batch_finished", "max"))
    return float((spans["end"] - spans["start"]).sum() + frame.loc[~batched, "wall_time"].sum())


def total_rate(frame: pd.DataFrame) -> float:
    """All new tokens of ``frame``'s questions over the time their run took to serve them (see DEFINITIONS)."""
    return _div(float(frame["tokens"].sum()), serving_seconds(frame)) if len(frame) else math.nan


def _group_ids(frame: pd.DataFrame) -> Iterable[tuple[str, pd.Index]]:
    for group in group_order():
        ids = frame.index if group == OVERALL else frame.index[frame["group"] == group]
        if len(ids):
            yield group, ids


def run_stats(comparison: Comparison, ratio: str = "mean") -> list[dict]:
    """One row per category group for one run against its baseline."""
    run = comparison.run
    common = run.ok_ids
    for base in comparison.baselines:
        common = common.intersection(base.ok_ids)
    rows = []
    for group, ids in _group_ids(run.frame):
        qids = ids.intersection(common)
        own = rates(run.frame.loc[qids], ratio)
        refs = [rates(base.frame.loc[qids], ratio) for base in comparison.baselines]
        ref = {key: sum(r[key] for r in refs) / len(refs) for key in own}
        # what the machine serves: every question the run answered, over the run's serving time (Overall only:
        # a group's questions were served among the others')
        total = total_rate(run.frame.loc[run.ok_ids]) if group == OVERALL else math.nan
        base_total = (sum(total_rate(b.frame.loc[b.ok_ids]) for b in comparison.baselines) / len(comparison.baselines)
                      if group == OVERALL else math.nan)
        rows.append({
            **dict(zip(SETUP_KEYS, comparison.setup)), "platform": comparison.platform,
            "label": run.label, "method": run.method, "baseline": comparison.reference.label,
            "series": run.series, "batch_size": run.batch_size, "total_tokens_per_s": total,
            "baseline_total_tokens_per_s": base_total,
            "run": run.index, "group": group, "n_questions": len(qids),
            "n_errors": int(run.frame.loc[ids, "error"].notna().sum()),
            "n_context": int(run.frame.loc[qids, "context_turns"].fillna(0).sum()),
            "too_long": ", ".join(str(q) for q in ids if str(run.frame.at[q, "error"]).startswith("PromptTooLong")),
            "speedup": _div(own["tokens_per_s"], ref["tokens_per_s"]),
            "mat": own["mat"],
            "tokens_per_s": own["tokens_per_s"],
            "baseline_tokens_per_s": ref["tokens_per_s"],
            "decode_speedup": _div(own["decode_tokens_per_s"], ref["decode_tokens_per_s"]),
            "decode_tokens_per_s": own["decode_tokens_per_s"],
            "prefill_ms": own["prefill_ms"],
            "provenance": comparison.provenance, "reference": comparison.is_reference, "ratio": ratio,
            "in_turn": comparison.in_turn, "partial": run.partial,
        })
    return rows


METRICS = ("speedup", "mat", "tokens_per_s", "decode_speedup", "decode_tokens_per_s", "prefill_ms")


def summarize(comparisons: Sequence[Comparison], ratio: str = "mean") -> pd.DataFrame:
    """The speedup table: one row per setup x platform x label x group, mean and ``<metric>_std`` over runs.

    n_questions is the fewest questions compared in any run, n_errors the errors summed over runs, n_context the
    turns that ended at the model's context (the most in any run), too_long the questions whose prompt alone
    filled it.
    """
    per_run = pd.DataFrame([row for c in comparisons for row in run_stats(c, ratio)])
    if per_run.empty:
        raise ResultError("nothing to compare: no runs were paired with a baseline")
    keys = [*SETUP_KEYS, "platform", "label", "method", "baseline", "group"]
    grouped = per_run.groupby(keys, sort=False, dropna=False)
    table = grouped.agg(
        n_runs=("run", "nunique"), n_questions=("n_questions", "min"), n_errors=("n_errors", "sum"),
        n_context=("n_context", "max"), too_long=("too_long", "first"),
        **{m: (m, "mean") for m in METRICS}, **{f"{m}_std": (m, "std") for m in METRICS},
        baseline_tokens_per_s=("baseline_tokens_per_s", "mean"),
        series=("series", "first"), batch_size=("batch_size", "first"),
        total_tokens_per_s=("total_tokens_per_s", "mean"), total_tokens_per_s_std=("total_tokens_per_s", "std"),
        baseline_total_tokens_per_s=("baseline_total_tokens_per_s", "mean"),
        provenance=("provenance", lambda p: "; ".join(dict.fromkeys(p))),
        reference=("reference", "all"), ratio=("ratio", "first"), in_turn=("in_turn", "all"),
        partial=("partial", lambda p: "; ".join(x for x in dict.fromkeys(p) if x)),
    ).reset_index()
    order = {g: i for i, g in enumerate(group_order())}
    table["_order"] = table["group"].map(order)
    table = table.sort_values([*SETUP_KEYS, "reference", "label", "_order"], ascending=[*[True] * 4, False, True, True])
    columns = [*keys, "n_runs", "n_questions", "n_errors", "n_context", "too_long",
               *(c for m in METRICS for c in (m, f"{m}_std")),
               "baseline_tokens_per_s", "series", "batch_size", "total_tokens_per_s", "total_tokens_per_s_std",
               "baseline_total_tokens_per_s", "provenance", "reference", "ratio", "in_turn", "partial"]
    return table[columns].reset_index(drop=True)


def batch_table(table: pd.DataFrame) -> pd.DataFrame:
    """Per setup, platform, method (its label without the batch size) and batch size, Overall: per-sequence tokens/s,
    total tokens/s, the speedup against the baseline at the same batch size (per sequence, and total) and the total
    tokens/s against the batch-1 baseline's where one is among the inputs. Empty unless a run's batch size is > 1."""
    overall = table[table["group"] == OVERALL]
    if not (overall["batch_size"] > 1).any():
        return pd.DataFrame()
    rows = []
    for _, part in overall.groupby([*SETUP_KEYS, "platform"], sort=False, dropna=False):
        single = part.loc[part["reference"] & (part["batch_size"] == 1), "total_tokens_per_s"]
        batch1 = single.mean() if len(single) else math.nan
        for _, row in part.iterrows():
            rows.append({**{k: row[k] for k in (*SETUP_KEYS, "platform", "series", "batch_size", "reference",
                                                 "n_runs", "n_questions", "mat", "tokens_per_s", "speedup",
                                                 "total_tokens_per_s", "baseline_total_tokens_per_s")},
                         "total_speedup": _div(row["total_tokens_per_s"], row["baseline_total_tokens_per_s"]),
                         "vs_batch1": _div(row["total_tokens_per_s"], batch1)})
    frame = pd.DataFrame(rows)
    return frame.sort_values([*SETUP_KEYS, "platform", "reference", "series", "batch_size"],
                             ascending=[*[True] * 5, False, True, True]).reset_index(drop=True)


def measured_speedups(batch: pd.DataFrame) -> dict[tuple, dict[int, float]]:
    """Per (setup..., platform, series) of a method: its speedup over the baseline at the same batch size, by batch
    size (methods.costs.crossover says where it stops paying)."""
    return {key: dict(zip(part["batch_size"].astype(int), part["speedup"]))
            for key, part in batch[~batch["reference"]].groupby([*SETUP_KEYS, "platform", "series"], sort=False)}


def per_question(comparisons: Sequence[Comparison]) -> pd.DataFrame:
    """One row per run x question: its tokens/s, the baseline's (mean over baseline runs) and their ratio."""
    frames = []
    for c in comparisons:
        frame = c.run.frame
        own = frame["tokens"] / frame["wall_time"]
        base = pd.concat([b.frame["tokens"] / b.frame["wall_time"] for b in c.baselines], axis=1)
        base = base.mean(axis=1, skipna=False)
        frames.append(pd.DataFrame({
            "label": c.run.label, "run": c.run.index, "category": frame["category"], "group": frame["group"],
            "error": frame["error"], "new_tokens": frame["tokens"].astype("Int64"), "wall_time": frame["wall_time"],
            "tokens_per_s": own, "baseline_tokens_per_s": base.reindex(frame.index),
            "speedup": own / base.reindex(frame.index), "mat": frame["accept_sum"] / frame["accept_steps"],
            "reference": c.is_reference,
        }).reset_index())
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def add_input_arguments(parser: argparse.ArgumentParser) -> None:
    """The input options every analysis command shares."""
    parser.add_argument("paths", nargs="*", default=["results"], metavar="PATH",
                        help="result files or folders, searched recursively for *.jsonl (default: results)")
    parser.add_argument("--baseline", action="append", metavar="PATH",
                        help="baseline result file(s) to compare every run with (repeat for several runs); "
                             "default: the run(s) of method 'baseline' with the same provenance")
    parser.add_argument("--force", action="store_true",
                        help="compare runs whose provenance differs or cannot be checked")
    parser.add_argument("--questions", metavar="PATH",
                        help="question file mapping question_id to category, for answer files without categories "
                             "(default: Spec-Bench's id ranges)")


def comparisons_from_args(args: argparse.Namespace) -> tuple[list[Comparison], list[str]]:
    """Load and pair the inputs named on the command line (see add_input_arguments)."""
    categories = load_categories(args.questions) if args.questions else None
    runs = load_runs(args.paths, categories)
    baselines = load_runs(args.baseline, categories) if args.baseline else None
    comparisons, notes = pair_runs(runs, baselines, args.force)
    if not comparisons:
        raise ResultError("nothing to compare; " + "; ".join(notes))
    return comparisons, notes


def default_out_dir(paths: Sequence[str | Path]) -> Path:
    """Where outputs go by default: the folder named, or the folder holding all the files named."""
    resolved = [Path(p).resolve() for p in paths]
    common = Path(os.path.commonpath(resolved))
    return common if common.is_dir() else common.parent


def setup_name(setup: Sequence[str]) -> str:
    """"model / data / dtype / device", for titles and headings."""
    if all(part == UNKNOWN for part in setup):
        return "setup unknown (no .meta.json)"
    return " / ".join(setup)
