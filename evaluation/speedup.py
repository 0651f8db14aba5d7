"""Speedup, MAT and tokens/s per Spec-Bench category group and method.

    python -m evaluation.speedup [PATH ...] [--ratio mean|total] [--out DIR] [--json]

Prints an aligned table and writes the same as speedup.md, speedup.csv and speedup.tex.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path
from typing import Sequence

import pandas as pd

from evaluation import status, steps
from evaluation.analysis import (CHECKED, DEFINITIONS, OVERALL, RATIOS, SETUP_KEYS, ResultError, add_input_arguments,
                                 batch_table, comparisons_from_args, default_out_dir, measured_speedups, setup_name,
                                 summarize)
from methods.costs import describe_crossover
from methods.paths import resolve_path

# Displayed columns: (header, table column, decimals); a column with a "<name>_std" shows mean ± std.
COLUMNS = (
    ("Method", "label", None), ("Group", "group", None), ("Runs", "n_runs", 0), ("N", "n_questions", 0),
    ("Err", "n_errors", 0), ("Speedup", "speedup", 2), ("MAT", "mat", 2), ("Tok/s", "tokens_per_s", 1),
    ("Base tok/s", "baseline_tokens_per_s", 1), ("Decode speedup", "decode_speedup", 2),
    ("Decode tok/s", "decode_tokens_per_s", 1), ("Prefill ms", "prefill_ms", 1),
)
DESCRIPTION = ("Speedup, MAT and tokens/s per Spec-Bench category group and method: prints an aligned table and "
               "writes it as speedup.md, speedup.csv and speedup.tex (in the results folder, or --out DIR).")
# A speedup whose std over repeated runs exceeds its distance from 1.0 cannot be told from no speedup.
NOISY = "†"
# A row with a run that recorded fewer questions than its header names (stopped, or still running).
PARTIAL = "‡"
NOISY_COLUMNS = ("speedup", "decode_speedup")
RATIO_TEXT = {
    "mean": "speedup = mean per-question tokens/s over the baseline's (Spec-Bench)",
    "total": "speedup = total tokens / total time, over the baseline's",
}


def number(value: float, decimals: int) -> str:
    return "n/a" if value is None or math.isnan(value) else f"{value:.{decimals}f}"


def noisy(row: pd.Series, column: str) -> bool:
    """Whether a method's speedup spreads over its runs by more than its distance from 1.0."""
    std = row.get(f"{column}_std")
    return (column in NOISY_COLUMNS and not row["reference"] and row["n_runs"] > 1 and std is not None
            and not math.isnan(std) and std > abs(row[column] - 1.0))


def display_rows(table: pd.DataFrame) -> list[list[str]]:
    """The table's cells as text, ``mean ± std`` where several runs exist; "*" marks unchecked provenance,
    NOISY a speedup within its spread of 1.0, PARTIAL a row with a partial run."""
    rows = []
    for _, row in table.iterrows():
        cells = []
        for _, column, decimals in COLUMNS:
            if decimals is None:
                cell = str(row[column])
                if column == "label":
                    cell += ("*" if row["provenance"] != CHECKED else "") + (PARTIAL if row["partial"] else "")
            else:
                cell = number(row[column], decimals)
                std = row.get(f"{column}_std")
                if std is not None and not math.isnan(std) and row["n_runs"] > 1:
                    cell += f" ± {number(std, decimals)}" + (NOISY if noisy(row, column) else "")
            cells.append(cell)
        rows.append(cells)
    return rows


def render_text(headers: Sequence[str], rows: list[list[str]], markdown: bool = False,
                left: Sequence[bool] | None = None) -> str:
    """Aligned columns, text left and numbers right; with pipes and an alignment row for Markdown."""
    left = left or [decimals is None for _, _, decimals in COLUMNS]
    widths = [max(3 if markdown else 1, *(len(r[i]) for r in [list(headers), *rows])) for i in range(len(headers))]

    def line(cells: Sequence[str]) -> str:
        padded = [c.ljust(w) if l else c.rjust(w) for c, w, l in zip(cells, widths, left)]
        return "| " + " | ".join(padded) + " |" if markdown else "  ".join(padded).rstrip()

    rule = ["-" * w if l or not markdown else "-" * (w - 1) + ":" for w, l in zip(widths, left)]
    return "\n".join([line(headers), line(rule), *(line(r) for r in rows)])


_LATEX = {"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_", "{": r"\{",
          "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}"}


def render_latex(headers: Sequence[str], rows: list[list[str]]) -> str:
    """A booktabs tabular."""
    def line(cells: Sequence[str]) -> str:
        escaped = (re.sub(r"[\\&%$#_{}~^]", lambda m: _LATEX[m.group()], c).replace("±", r"$\pm$")
                   .replace(NOISY, r"$^\dagger$").replace(PARTIAL, r"$^\ddagger$") for c in cells)
        return " & ".join(escaped) + r" \\"

    spec = "".join("l" if decimals is None else "r" for _, _, decimals in COLUMNS)
    return "\n".join([rf"\begin{{tabular}}{{{spec}}}", r"\toprule", line(headers), r"\midrule",
                      *(line(r) for r in rows), r"\bottomrule", r"\end{tabular}"])


def sections(table: pd.DataFrame) -> list[tuple[str, pd.DataFrame]]:
    """One section per setup and platform (the hardware its rows were measured on)."""
    return [(f"{setup_name(key[:-1])} on {key[-1]}", part)
            for key, part in table.groupby([*SETUP_KEYS, "platform"], sort=False)]


def timed_apart(part: pd.DataFrame) -> list[str]:
    """The methods (labels) not timed in turn with their baseline: a drift in the machine's speed enters their
    speedup."""
    methods = part.loc[~part["reference"]]
    return list(dict.fromkeys(methods.loc[~methods["in_turn"], "label"]))


def unchecked(part: pd.DataFrame) -> list[tuple[str, str]]:
    """(label, provenance) of the rows marked "*": their provenance was not (fully) checked."""
    rows = part.loc[part["provenance"] != CHECKED, ["label", "provenance"]].drop_duplicates()
    return list(rows.itertuples(index=False, name=None))


def noisy_rows(part: pd.DataFrame) -> list[tuple[str, str, str]]:
    """(label, group, column) of every speedup marked NOISY."""
    return [(row["label"], row["group"], column) for _, row in part.iterrows() for column in NOISY_COLUMNS
            if noisy(row, column)]


def _notes(part: pd.DataFrame) -> list[str]:
    baselines = ", ".join(dict.fromkeys(part["baseline"]))
    notes = [f"baseline: {baselines}; {RATIO_TEXT[part['ratio'].iloc[0]]}; N: questions compared (fewest over "
             "runs); Err: failed questions (all runs); mean ± std over runs"]
    apart = timed_apart(part)
    if (~part["reference"]).any() and not apart:
        notes.append("every method was timed in turn with the baseline, question by question (evaluation.interleave)")
    elif apart:
        notes.append(f"timed apart from the baseline (one run after another, so a drift in the machine's speed enters "
                     f"the speedup; evaluation.interleave times them in turn): {', '.join(apart)}")
    notes += [f"* {label}: provenance {provenance}" for label, provenance in unchecked(part)]
    partial = "; ".join(dict.fromkeys(p for p in part["partial"] if p))
    if partial:
        notes.append(f"{PARTIAL} partial, compared on the questions it answered only (its baseline on the same ones), "
                     f"never as a whole run: {partial}")
    overall = part.loc[part["group"] == OVERALL]
    ended = [f"{label} {n}" for label, n in zip(overall["label"], overall["n_context"]) if n]
    if ended:
        notes.append("turns that ended at the model's context (prompt + answer fill it; the same rule for every method, "
                     "where Spec-Bench's drafting loops stop at 1,960 tokens): " + ", ".join(ended))
    too_long = "; ".join(dict.fromkeys(f"{label}: question {q}" for label, q in zip(overall["label"], overall["too_long"]) if q))
    if too_long:
        notes.append(f"Err includes prompts that alone fill the model's context (error records): {too_long}")
    if noisy_rows(part):
        notes.append(f"{NOISY} the std over runs is larger than the distance from 1.0: this speedup cannot be told "
                     "from no speedup; run more repeats (run.id=0,1,2,...)")
    return notes


def records(table: pd.DataFrame) -> list[dict]:
    """The table as JSON-ready records (what --json prints; NaN as None)."""
    return json.loads(table.to_json(orient="records"))


def format_table(table: pd.DataFrame, style: str = "text") -> str:
    """The table as terminal text, Markdown ("md") or LaTeX ("tex"), one section per setup."""
    headers = [h for h, _, _ in COLUMNS]
    out = []
    for name, part in sections(table):
        notes = _notes(part)
        if style == "md":
            body = render_text(headers, display_rows(part), markdown=True)
            out.append(f"### {name}\n\n{body}\n\n" + "\n".join(f"- {n}" for n in notes))
        elif style == "tex":
            body = render_latex(headers, display_rows(part))
            out.append("\n".join([f"% {name}", *(f"% {n}" for n in notes), body]))
        else:
            out.append("\n".join([name, render_text(headers, display_rows(part)), *notes]))
    return "\n\n".join(out) + "\n"


PERCENT = "%"
ACCEPTANCE_COLUMNS = (
    ("Method", "label", None), ("Steps", "steps", 0), ("Draft %", "draft_rate", PERCENT),
    *((f"d{d}", f"d{d}", PERCENT) for d in range(1, steps.MAX_DEPTH + 1)),
    *((f"r{r}", f"r{r}", PERCENT) for r in range(steps.MAX_RANK)),
)
ACCEPTANCE_TEXT = ("acceptance over drafting steps (at least one draft node; Draft % of all decode steps): dN = share "
                   "that accepted a node at depth N, rN = share whose accepted depth-1 node was its parent's "
                   "(N+1)-th child (rank N); pooled over runs")
COST_COLUMNS = (
    ("Method", "label", None), ("Runs", "n_runs", 0), ("Decode tok/s", "decode_tokens_per_s", 1),
    ("Calibrated tok/s", "calibrated_decode_tokens_per_s", 1), ("MAT", "mat", 2), ("Pred. MAT", "predicted_mat", 2),
    ("Pred. tok/s", "predicted_decode_tokens_per_s", 1), ("Outside fwd %", "outside_forward", PERCENT),
    ("Plan changes", "plan_changes", 0),
)
COST_TEXT = ("cost model, Overall, total decode tokens / decode time: Calibrated tok/s = what the device calibration "
             "predicts for the steps the run made (checks the calibration); Pred. MAT / Pred. tok/s = what a "
             "tree=auto plan predicted from calibration x acceptance statistics (checks the statistics); Outside fwd "
             "% = decode time outside the model forward (engine + drafter); Plan changes = how often an =auto plan "
             "corrected itself during the run (autotree.online); n/a: no calibration for the run's machine, or no "
             "plan")


def simple_table(frame: pd.DataFrame, columns: Sequence[tuple], title: str, style: str) -> str:
    """A plain table (no std) per setup, as text or Markdown, with one explanatory line."""
    headers = [h for h, _, _ in columns]
    left = [d is None for _, _, d in columns]
    out = []
    for (*setup, platform), part in frame.groupby([*SETUP_KEYS, "platform"], sort=False):
        rows = [[str(row[c]) if d is None else number(100 * row[c], 1) if d == PERCENT else number(row[c], d)
                 for _, c, d in columns] for _, row in part.iterrows()]
        body = render_text(headers, rows, markdown=style == "md", left=left)
        where = f"{setup_name(setup)} on {platform}"
        head = f"### {title} ({where})" if style == "md" else f"{title} ({where})"
        out.append(f"{head}\n\n{body}\n\n- " if style == "md" else f"{head}\n{body}\n")
    return "\n".join(out)


SOURCES_TEXT = ("draft sources: the share of decode steps by what the drafter verified (SAM: retrieval = the "
                "retrieved chain alone, aux = the auxiliary drafter's draft alone, merged = both in one tree, none "
                "= no draft); pooled over runs")


def source_columns(frame: pd.DataFrame) -> tuple:
    """The draft-sources table's columns: one per source that some drafter reported."""
    fixed = ("platform", "label", "group", "steps", *SETUP_KEYS)
    return (("Method", "label", None), ("Group", "group", None), ("Steps", "steps", 0),
            *((source, source, PERCENT) for source in frame.columns if source not in fixed))


BATCH_COLUMNS = (
    ("Method", "series", None), ("B", "batch_size", 0), ("Runs", "n_runs", 0), ("N", "n_questions", 0),
    ("MAT", "mat", 2), ("Seq tok/s", "tokens_per_s", 1), ("Total tok/s", "total_tokens_per_s", 1),
    ("Speedup", "speedup", 2), ("Total speedup", "total_speedup", 2), ("vs B=1", "vs_batch1", 2),
)
BATCH_TEXT = ("by batch size B (Overall; B > 1: B questions at once, continuous batching): Seq tok/s = mean per-question "
              "tokens/s (what a user waits for); Total tok/s = all new tokens / the run's serving time (what the "
              "machine serves); Speedup = per sequence, against the baseline at the same B (whether speculation pays "
              "there); Total speedup = Total tok/s against that baseline's; vs B=1 = Total tok/s against the batch-1 "
              "baseline's (n/a without one among the inputs)")


def format_batch(batch: pd.DataFrame, style: str = "text", predicted: pd.DataFrame | None = None) -> str:
    """The table by batch size with, per method, where it stops paying: measured (its speedups at the batch sizes
    run) and, given ``predicted`` (evaluation.steps.batch_prediction), predicted by the cost model."""
    if batch.empty:
        return ""
    lines = [f"measured: {key[-1]}: {describe_crossover(speedups)}"
             for key, speedups in measured_speedups(batch).items()]
    for _, row in (predicted if predicted is not None else pd.DataFrame()).iterrows():
        at = ", ".join(f"B={b} {v:.2f}" for b, v in sorted(row["predicted"].items()))
        lines.append(f"predicted (calibration x its steps at B={row['from_batch_size']}, the forward's cost only): "
                     f"{row['series']}: {row['text']} ({at})")
    table = simple_table(batch, BATCH_COLUMNS, "Speedup by batch size", style)
    bullet = "- " if style == "md" else ""
    return table + BATCH_TEXT + "".join(f"\n{bullet}{line}" for line in lines) + "\n"


def format_steps(accepted: pd.DataFrame, cost: pd.DataFrame, style: str = "text",
                 drafted: pd.DataFrame | None = None) -> str:
    """The acceptance, cost-model and draft-sources tables (empty for result files without per-step records)."""
    drafted = pd.DataFrame() if drafted is None else drafted
    parts = []
    for frame, columns, title, text in ((accepted, ACCEPTANCE_COLUMNS, "Acceptance by depth and rank", ACCEPTANCE_TEXT),
                                        (cost, COST_COLUMNS, "Cost model", COST_TEXT),
                                        (drafted, source_columns(drafted), "Draft sources", SOURCES_TEXT)):
        if not frame.empty:
            extra = steps.warnings(frame) if frame is cost else []
            parts.append(simple_table(frame, columns, title, style) + text +
                         "".join(f"\n{'- ' if style == 'md' else ''}{w}" for w in extra))
    return "\n\n".join(parts) + ("\n" if parts else "")


def write_outputs(table: pd.DataFrame, out_dir: Path, accepted: pd.DataFrame | None = None,
                  cost: pd.DataFrame | None = None, drafted: pd.DataFrame | None = None,
                  pending: Sequence[str] = (), predicted: pd.DataFrame | None = None) -> list[Path]:
    """speedup.md, speedup.csv and speedup.tex under ``out_dir`` (+ acceptance.csv, cost_model.csv, sources.csv,
    batch.csv); ``pending``: the lines naming the jobs not done, under the Markdown table."""
    out_dir.mkdir(parents=True, exist_ok=True)
    accepted = pd.DataFrame() if accepted is None else accepted
    cost = pd.DataFrame() if cost is None else cost
    drafted = pd.DataFrame() if drafted is None else drafted
    paths = [out_dir / f"speedup.{ext}" for ext in ("md", "csv", "tex")]
    batch = batch_table(table)
    extra = "\n".join(part for part in (format_batch(batch, "md", predicted),
                                       format_steps(accepted, cost, "md", drafted)) if part)
    unfinished = "\n".join(["", pending[0], "", *(f"- {line.strip()}" for line in pending[1:]), ""]) if pending else ""
    paths[0].write_text(format_table(table, "md") + unfinished + ("\n" + extra if extra else ""), encoding="utf-8")
    table.to_csv(paths[1], index=False)
    paths[2].write_text(format_table(table, "tex"), encoding="utf-8")
    for name, frame in (("acceptance", accepted), ("cost_model", cost), ("sources", drafted), ("batch", batch)):
        if not frame.empty:
            paths.append(out_dir / f"{name}.csv")
            frame.to_csv(paths[-1], index=False)
    return paths


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m evaluation.speedup", description=DESCRIPTION,
                                     epilog=DEFINITIONS, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_input_arguments(parser)
    parser.add_argument("--ratio", choices=RATIOS, default="mean",
                        help="mean: ratio of mean per-question tokens/s (Spec-Bench, default); "
                             "total: ratio of total tokens / total time")
    parser.add_argument("--out", type=Path, metavar="DIR",
                        help="where to write speedup.md/.csv/.tex (default: the results folder)")
    parser.add_argument("--json", action="store_true",
                        help="print the table as JSON (one object per setup x method x group) instead of text")
    parser.add_argument("--calibration", type=Path, default=Path("results/calibration"), metavar="DIR",
                        help="where device calibrations are (python -m evaluation.calibrate; default: "
                             "results/calibration), for the cost-model table")
    args = parser.parse_args(argv)
    try:
        comparisons, notes = comparisons_from_args(args)
        table = summarize(comparisons, args.ratio)
    except ResultError as err:
        print(f"speedup: error: {err}", file=sys.stderr)
        return 2
    for note in notes:
        print(f"speedup: {note}", file=sys.stderr)
    accepted = steps.acceptance(comparisons)
    cost = steps.cost_model(comparisons, resolve_path(args.calibration))
    drafted = steps.sources(comparisons)
    predicted = steps.batch_prediction(comparisons, resolve_path(args.calibration))
    pending = status.not_done([resolve_path(p) for p in args.paths if resolve_path(p).is_dir()])
    if args.json:
        print(json.dumps(records(table), indent=1))
        for line in pending:
            print(f"speedup: {line}", file=sys.stderr)
    else:
        print(format_table(table), end="")
        print("\n".join(["", *pending, ""]) if pending else "", end="")
        extra = "\n".join(part for part in (format_batch(batch_table(table), predicted=predicted),
                                           format_steps(accepted, cost, drafted=drafted)) if part)
        print("\n" + extra if extra else "", end="")
    paths = write_outputs(table, args.out or default_out_dir(args.paths), accepted, cost, drafted, pending, predicted)
    print(f"speedup: wrote {', '.join(map(str, paths))}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
