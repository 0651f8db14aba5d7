"""Question files: Spec-Bench's format, clear errors, selection."""

import json
from pathlib import Path

import pytest

from evaluation.categories import group_of
from evaluation.data import DataError, humaneval_questions, read_questions, select
from methods.paths import PROJECT_ROOT

SHARED = PROJECT_ROOT.parent / "shared" / "spec_bench" / "question.jsonl"


def write(tmp_path: Path, lines: list[str]) -> Path:
    path = tmp_path / "q.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def q(qid, category="qa", turns=("hi",)):
    return json.dumps({"question_id": qid, "category": category, "turns": list(turns)})


def test_malformed_line_names_file_and_line(tmp_path):
    path = write(tmp_path, [q(1), '{"question_id": 2, "category": "qa", "turns": ["a"]', q(3)])
    with pytest.raises(DataError, match=rf"{path}:2: not valid JSON"):
        read_questions(path)


@pytest.mark.parametrize("bad, message", [
    ('{"question_id": 1, "category": "qa"}', "'turns'"),
    ('{"question_id": 1, "category": "qa", "turns": []}', "'turns'"),
    ('{"question_id": 1, "category": "qa", "turns": ["  "]}', "'turns'"),
    ('{"category": "qa", "turns": ["a"]}', "'question_id'"),
    ('[1, 2]', "JSON object"),
])
def test_invalid_questions_are_refused(tmp_path, bad, message):
    with pytest.raises(DataError, match=message):
        read_questions(write(tmp_path, [q(0), bad]))


def test_duplicate_ids_are_refused(tmp_path):
    with pytest.raises(DataError, match=r":3: duplicate question_id 1 \(first at line 1\)"):
        read_questions(write(tmp_path, [q(1), q(2), q(1)]))


def test_missing_file_says_what_to_do(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        read_questions(tmp_path / "none.jsonl")


def test_unknown_category_is_allowed_and_grouped_as_other(tmp_path):
    questions = read_questions(write(tmp_path, [q(1, "poetry")]))
    assert group_of(questions[0]["category"]) == "Other"


def test_selection():
    questions = [{"question_id": i, "category": c, "turns": ["x"]}
                 for i, c in enumerate(["writing", "math", "qa", "qa", "qa", "rag", "writing"], start=1)]
    assert [x["question_id"] for x in select(questions, per_category=2)] == [1, 2, 3, 4, 6]
    assert [x["question_id"] for x in select(questions, categories=["qa"], limit=2)] == [3, 4]
    assert [x["question_id"] for x in select(questions, ids=[2, 4])] == [2, 3, 4]
    with pytest.raises(DataError, match="kept no question"):
        select(questions, categories=["translation"])


def test_spec_bench_mini_covers_the_six_subtasks():
    questions = read_questions(PROJECT_ROOT / "data" / "spec_bench_mini" / "question.jsonl")
    groups = [group_of(x["category"]) for x in questions]
    assert {g: groups.count(g) for g in set(groups)} == {"MT": 4, "Trans": 4, "Sum": 4, "QA": 4, "Math": 4, "RAG": 4}
    assert all(len(x["turns"]) == 2 for x in questions if group_of(x["category"]) == "MT")
    long_docs = [x for x in questions if x["category"] in ("summarization", "rag")]
    assert all(len(x["turns"][0].split()) >= 300 for x in long_docs)


@pytest.mark.skipif(not SHARED.exists(), reason="the Spec-Bench question file is not beside the project")
def test_spec_bench_per_category_sample_covers_every_group():
    questions = read_questions(SHARED)
    assert len(questions) == 480
    sample = select(questions, per_category=10)
    assert len(sample) == 60
    assert {group_of(x["category"]) for x in sample} == {"MT", "Trans", "Sum", "QA", "Math", "RAG"}


def test_humaneval_is_164_code_questions():
    questions = humaneval_questions()
    assert len(questions) == 164 and {x["category"] for x in questions} == {"code"}
    assert "def " in questions[0]["turns"][0]


def test_statistics_questions_are_held_out_of_the_evaluated_set(tmp_path):
    from evaluation.data import heldout

    path = write(tmp_path, [q(i, category, turns=(f"{category} {i}",)) for i, category in
                            enumerate(["qa"] * 5 + ["writing", "roleplay"] * 3 + ["translation"] * 2)])
    cfg = {"path": str(path), "format": "jsonl", "per_category": 2}
    evaluated = {x["question_id"] for x in select(read_questions(path), per_category=2)}
    held = heldout(cfg, per_group=2)
    assert not evaluated & {x["question_id"] for x in held}  # none of them evaluated
    assert [(x["category"], group_of(x["category"])) for x in held] == [
        ("qa", "QA"), ("qa", "QA"), ("writing", "MT"), ("roleplay", "MT")]  # 2 per group; Trans has none left
    with pytest.raises(DataError, match="no held-out question"):
        heldout({"path": str(path), "format": "jsonl", "categories": ["translation"]}, per_group=2)


@pytest.mark.skipif(not SHARED.exists(), reason="the Spec-Bench question file is not beside the project")
def test_spec_bench_mini_takes_its_statistics_from_spec_bench():
    from evaluation.data import heldout

    mini = {"path": str(PROJECT_ROOT / "data" / "spec_bench_mini" / "question.jsonl"), "format": "jsonl"}
    held = heldout(mini, per_group=2, source={"path": str(SHARED), "format": "jsonl"})
    mini_questions = read_questions(mini["path"])
    assert {x["category"] for x in held} <= {x["category"] for x in mini_questions}
    assert len(held) == 2 * len({group_of(x["category"]) for x in mini_questions})
    assert not {json.dumps(x["turns"]) for x in held} & {json.dumps(x["turns"]) for x in mini_questions}
