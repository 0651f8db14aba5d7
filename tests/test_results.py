"""Result files: durable appends, resume, partial lines, refusal on a changed configuration."""

import json

import pytest

from evaluation.results import ResultFile, ResumeRefused, diff_keys, meta_path

HEADER = {"model": "m", "method": "baseline", "config": {"max_new_tokens": 8, "data": {"limit": 2}}, "started": "t0"}


def test_append_and_resume(tmp_path):
    path = tmp_path / "r.jsonl"
    with ResultFile(path, HEADER) as f:
        f.append({"question_id": 1})
    with ResultFile(path, {**HEADER, "started": "t1"}) as f:
        assert f.done == {1}
        f.append({"question_id": 2})
    assert [json.loads(line)["question_id"] for line in path.read_text().splitlines()] == [1, 2]
    assert json.loads(meta_path(path).read_text())["started"] == "t0"


def test_partial_last_line_is_dropped(tmp_path):
    path = tmp_path / "r.jsonl"
    with ResultFile(path, HEADER) as f:
        f.append({"question_id": 1})
    with open(path, "a") as raw:
        raw.write('{"question_id": 2, "choi')  # a kill mid-write
    f = ResultFile(path, HEADER)
    assert f.done == {1} and any("partial" in note for note in f.notes)
    f.close()
    assert path.read_text() == '{"question_id": 1}\n'


def test_changed_configuration_refuses_to_resume(tmp_path):
    path = tmp_path / "r.jsonl"
    ResultFile(path, HEADER).close()
    changed = {**HEADER, "config": {"max_new_tokens": 16, "data": {"limit": 2}}}
    with pytest.raises(ResumeRefused, match="config.max_new_tokens"):
        ResultFile(path, changed)


def test_resume_false_moves_the_old_file_aside(tmp_path):
    path = tmp_path / "r.jsonl"
    with ResultFile(path, HEADER) as f:
        f.append({"question_id": 1})
    with ResultFile(path, HEADER, resume=False) as f:
        assert f.done == set()
    assert len(list(tmp_path.glob("r.jsonl.bak-*"))) == 1


def test_other_schema_refuses(tmp_path):
    path = tmp_path / "r.jsonl"
    ResultFile(path, HEADER).close()
    meta = json.loads(meta_path(path).read_text())
    meta_path(path).write_text(json.dumps({**meta, "schema": 0}))
    with pytest.raises(ResumeRefused, match="schema 0"):
        ResultFile(path, HEADER)


def test_diff_keys_names_nested_keys():
    assert diff_keys({"a": {"b": 1, "c": 2}}, {"a": {"b": 1, "c": 3}, "d": 0}) == ["a.c", "d"]
