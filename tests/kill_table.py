"""docs/reliability.md's table of stop-and-resume runs, measured: ``python tests/kill_table.py [--write FILE]``.

Each row is one scenario of tests/test_survival.py run once on the tiny checkpoint (a minute in all); ``--write``
replaces the table between the ``<!-- kill-table -->`` markers of FILE, so that no figure in it is typed by hand.
"""

from __future__ import annotations

import argparse
import re
import signal
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # this checkout's packages and the tests' helpers

from helpers import tiny_checkpoint  # noqa: E402
from test_survival import N_QUESTIONS, stop_a_run, stop_an_interleaved_run  # noqa: E402

HEADERS = ("signal", "run", "stopped", "recorded at the stop", "exit status", "every line whole", "resumed by",
           "questions after", "duplicates", "outputs equal")


def rows() -> list[list[str]]:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        checkpoint = tiny_checkpoint(root / "tiny", ends=False)
        scenarios = [
            lambda t: stop_a_run(checkpoint, t, signal.SIGTERM),
            lambda t: stop_a_run(checkpoint, t, signal.SIGUSR2),
            lambda t: stop_a_run(checkpoint, t, signal.SIGUSR2, launcher="submitit_local"),
            lambda t: stop_a_run(checkpoint, t, signal.SIGUSR2, launcher="submitit_local", timeout_min=1),
            lambda t: stop_an_interleaved_run(checkpoint, t, signal.SIGTERM),
        ]
        out = []
        for i, scenario in enumerate(scenarios):
            (root / str(i)).mkdir()
            row = scenario(root / str(i))
            how = row["how"] + (", timeout_min=1: counts as a time limit" if i == 3 else "")
            out.append([row["signal"], how, row["when"], str(row["recorded"]), str(row["exit"]),
                        "yes" if row["whole"] else "NO", row["rerun"],
                        f"{N_QUESTIONS} of {N_QUESTIONS}" if row["complete"] else "INCOMPLETE",
                        str(row["duplicates"]), "yes" if row["equal"] else "NO"])
        return out


def markdown(table: list[list[str]]) -> str:
    lines = ["| " + " | ".join(HEADERS) + " |", "|" + "---|" * len(HEADERS)]
    return "\n".join([*lines, *("| " + " | ".join(r) + " |" for r in table)])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", type=Path, metavar="FILE", help="replace the table between FILE's markers")
    args = parser.parse_args()
    table = markdown(rows())
    print(table)
    if args.write:
        text = args.write.read_text(encoding="utf-8")
        marked = re.compile(r"(<!-- kill-table -->\n)(?:.*?\n)?(<!-- /kill-table -->)", re.S)
        if not marked.search(text):
            sys.exit(f"{args.write} has no <!-- kill-table --> ... <!-- /kill-table --> markers")
        args.write.write_text(marked.sub(lambda m: m[1] + table + "\n" + m[2], text), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
