"""notebooks/compare.ipynb runs top to bottom headless on a small results folder (a baseline and one method)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parent.parent
OURS = Path(__file__).parent / "fixtures" / "analysis" / "results" / "tiny" / "mini"


def test_compare_notebook_executes(tmp_path, monkeypatch):
    folder = tmp_path / "results" / "tiny" / "mini"
    folder.mkdir(parents=True)
    for stem in ("baseline-float32-cpu-run0", "pld-float32-cpu-run0"):  # pld has a mismatch and a missing question
        shutil.copy(OURS / f"{stem}.jsonl", folder / f"{stem}.jsonl")
        meta = json.loads((OURS / f"{stem}.meta.json").read_text())
        meta["config"] = {}  # no model config: the mismatch context shows token ids without loading a tokenizer
        (folder / f"{stem}.meta.json").write_text(json.dumps(meta))
    monkeypatch.setenv("DRAFTBENCH_RESULTS", str(tmp_path / "results"))
    notebook = nbformat.read(ROOT / "notebooks" / "compare.ipynb", as_version=4)
    NotebookClient(notebook, kernel_name="python3", timeout=None,  # no wall-clock limit: shared cores
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = [out for cell in notebook.cells if cell.cell_type == "code" for out in cell.outputs]
    assert not [out for out in outputs if out.output_type == "error"]
    text = json.dumps([out.get("data", {}).get("text/markdown", "") + out.get("text", "")
                       + out.get("data", {}).get("text/plain", "") for out in outputs])
    assert "pld" in text and "tiny / mini / float32 / cpu" in text
    assert "question 161 not in" in text  # the missing question is reported
    assert sum("image/png" in out.get("data", {}) for out in outputs) == 3
