"""Token-level equality of each run's answers with its baseline's: the losslessness check.

    python -m evaluation.equal [PATH ...] [--strict] [--json]
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from dataclasses import asdict, dataclass, field
from typing import Callable, Sequence

import pandas as pd

from evaluation.analysis import (CHECKED, Comparison, ResultError, Run, add_input_arguments, batch1_references,
                                 comparisons_from_args, setup_name)

Decoder = Callable[[Sequence], str]
TOKEN_WINDOW, CHAR_WINDOW = 8, 40

DESCRIPTION = """\
Compare every run's answers with its baseline's, question by question and turn by turn: output_ids
token by token (the turns' text, character by character, for files without output_ids, such as
Spec-Bench answer files). The reference is the baseline's lowest-numbered run; its other runs are
checked against it too. Reports the identical answers, and for each mismatch the question, the turn,
the first divergent token and the decoded text around it; questions missing from either file
(including ids the run header lists but the file lacks) and failed questions are reported, never
skipped silently. A run of batch size B > 1 (its baseline's too) is compared with the batch-1
baseline's reference run where one of the same setup is among the inputs: every row must equal
batch-1 decoding. Exit status: 1 with --strict when anything differs, is missing or failed, or when
there is no run to check; 2 when the inputs cannot be read or compared."""


@dataclass
class Mismatch:
    question_id: int
    turn: int
    index: int  # first divergent token (character when compared by text)
    baseline: str  # "before | after" the divergence
    method: str


@dataclass
class EqualityReport:
    label: str
    run: int
    path: str
    baseline_label: str
    baseline_run: int
    baseline_path: str
    provenance: str
    by_text: bool = False
    n_questions: int = 0  # compared: present and without error on both sides
    n_identical: int = 0
    n_turns: int = 0
    n_identical_turns: int = 0
    mismatches: list[Mismatch] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.mismatches or self.missing or self.errors)


def first_divergence(a: Sequence, b: Sequence) -> int | None:
    """Index of the first differing element (the shorter length when one is a prefix of the other); None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def around(seq: Sequence, index: int, decode: Decoder, width: int) -> str:
    """The decoded text before and after ``index``, quoted so whitespace shows."""
    return f"{decode(seq[max(0, index - width):index])!r} | {decode(seq[index:index + width])!r}"


@functools.lru_cache(maxsize=None)
def _tokenizer(model_cfg_json: str) -> object | None:
    try:
        from evaluation.models import load_tokenizer

        return load_tokenizer(json.loads(model_cfg_json))
    except Exception as err:  # noqa: BLE001 -- any failure only costs readable context
        print(f"equal: cannot load the tokenizer ({type(err).__name__}: {err}); showing token ids", file=sys.stderr)
        return None


def tokenizer_decoder(meta: dict | None) -> Decoder:
    """Decode with the run's tokenizer, loaded on first use; token ids as text when it cannot be loaded."""
    def decode(ids: Sequence) -> str:
        model_cfg = (meta or {}).get("config", {}).get("model")
        tokenizer = _tokenizer(json.dumps(model_cfg, sort_keys=True)) if model_cfg else None
        return tokenizer.decode(list(ids)) if tokenizer is not None else " ".join(map(str, ids))
    return decode


def _expected_ids(*runs: Run) -> list[int]:
    ids = set()
    for run in runs:
        ids |= set(run.frame.index) | set((run.meta or {}).get("question_ids") or ())
    return sorted(ids)


def _lacks_ids(run: Run) -> bool:
    return bool(run.frame.loc[run.ok_ids, "output_ids"].isna().any())


def compare(run: Run, reference: Run, decode: Decoder, decode_reference: Decoder | None = None,
            provenance: str = CHECKED) -> EqualityReport:
    """Compare ``run``'s answers with ``reference``'s (see DESCRIPTION)."""
    by_text = _lacks_ids(run) or _lacks_ids(reference)
    column, width = ("turns", CHAR_WINDOW) if by_text else ("output_ids", TOKEN_WINDOW)
    if by_text:
        decode = decode_reference = "".join
    report = EqualityReport(run.label, run.index, str(run.path), reference.label, reference.index,
                            str(reference.path), provenance, by_text)
    for qid in _expected_ids(run, reference):
        present = [side for side in (reference, run) if qid in side.frame.index]
        report.missing += [f"question {qid} not in {side.path}" for side in (reference, run) if side not in present]
        failed = [side for side in present if pd.notna(side.frame.at[qid, "error"])]
        report.errors += [f"question {qid} failed in {side.path}: {side.frame.at[qid, 'error']}" for side in failed]
        if len(present) < 2 or failed:
            continue
        theirs, mine = reference.frame.at[qid, column], run.frame.at[qid, column]
        n_turns = max(len(mine), len(theirs))
        theirs, mine = [*theirs, *[[]] * (n_turns - len(theirs))], [*mine, *[[]] * (n_turns - len(mine))]
        report.n_questions += 1
        report.n_turns += n_turns
        identical = True
        for turn, (a, b) in enumerate(zip(theirs, mine)):
            index = first_divergence(a, b)
            if index is None:
                report.n_identical_turns += 1
                continue
            identical = False
            report.mismatches.append(Mismatch(qid, turn, index, around(a, index, decode_reference or decode, width),
                                              around(b, index, decode, width)))
        report.n_identical += identical
    return report


def check(comparisons: Sequence[Comparison], decoder_factory: Callable[[dict | None], Decoder] = tokenizer_decoder
          ) -> list[tuple[Comparison, EqualityReport]]:
    """A report for every run that is not its own reference; a batched run against the batch-1 baseline where there
    is one (analysis.batch1_references)."""
    singles = batch1_references(comparisons)
    pairs = []
    for c in comparisons:
        reference = singles.get(id(c.run), c.reference)
        if c.run is not reference:
            pairs.append((c, compare(c.run, reference, decoder_factory(c.run.meta), decoder_factory(reference.meta),
                                     c.provenance)))
    return pairs


def format_report(report: EqualityReport, setup: str) -> str:
    """A readable block for one run."""
    unit = "character" if report.by_text else "token"
    lines = [f"{report.label} run {report.run} vs {report.baseline_label} run {report.baseline_run} [{setup}]: "
             f"{report.n_identical}/{report.n_questions} answers identical "
             f"({report.n_identical_turns}/{report.n_turns} turns)",
             f"  files: {report.path} vs {report.baseline_path}"]
    if report.provenance != CHECKED:
        lines.append(f"  provenance: {report.provenance}")
    if report.by_text:
        lines.append("  compared by text (a file has no output_ids)")
    lines += [f"  missing: {m}" for m in report.missing] + [f"  error: {e}" for e in report.errors]
    width = max(len(report.baseline_label), len(report.label)) + 1
    for m in report.mismatches:
        lines += [f"  mismatch: question {m.question_id}, turn {m.turn}, first divergent {unit} {m.index}",
                  f"    {report.baseline_label + ':':<{width}} {m.baseline}",
                  f"    {report.label + ':':<{width}} {m.method}"]
    return "\n".join(lines)


def records(pairs: Sequence[tuple[Comparison, EqualityReport]]) -> list[dict]:
    """The reports as JSON-ready records (what --json prints)."""
    return [{**asdict(r), "ok": r.ok} for _, r in pairs]


def summarize(pairs: Sequence[tuple[Comparison, EqualityReport]]) -> str:
    """One line: all identical, or how many runs differ and how."""
    bad = [r for _, r in pairs if not r.ok]
    if not pairs:
        return "nothing to check: no run besides the baselines' reference runs"
    if bad:
        return (f"{len(bad)} of {len(pairs)} runs differ from their baseline: "
                f"{sum(len(r.mismatches) for r in bad)} mismatched turns, "
                f"{sum(len(r.missing) for r in bad)} missing and {sum(len(r.errors) for r in bad)} failed questions")
    return f"all answers identical in {len(pairs)} runs"


def main(argv: Sequence[str] | None = None,
         decoder_factory: Callable[[dict | None], Decoder] = tokenizer_decoder) -> int:
    parser = argparse.ArgumentParser(prog="python -m evaluation.equal", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_input_arguments(parser)
    parser.add_argument("--strict", action="store_true",
                        help="exit 1 on any mismatch, missing or failed question, or when there is nothing to "
                             "check (CI runs this on float32 runs)")
    parser.add_argument("--json", action="store_true", help="print the reports as JSON")
    args = parser.parse_args(argv)
    try:
        comparisons, notes = comparisons_from_args(args)
    except ResultError as err:
        print(f"equal: error: {err}", file=sys.stderr)
        return 2
    for note in notes:
        print(f"equal: {note}", file=sys.stderr)
    pairs = check(comparisons, decoder_factory)
    if args.json:
        print(json.dumps(records(pairs), indent=1))
    else:
        print("\n".join(format_report(r, setup_name(c.setup)) for c, r in pairs))
    print(f"equal: {summarize(pairs)}", file=sys.stderr)
    return 1 if args.strict and (not pairs or any(not r.ok for _, r in pairs)) else 0


if __name__ == "__main__":
    sys.exit(main())
