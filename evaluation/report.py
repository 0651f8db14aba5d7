"""One self-contained report of a benchmark, from its result files alone.

    python -m evaluation.report RUN_DIR [--out DIR] [--ratio mean|total] [--calibration DIR]

Writes, in RUN_DIR or --out DIR:
  report.md    for a repository or a paper draft, its PNG plots beside it in report_files/;
  report.html  one file to open in a browser: the same, plots inline, no script, no network;
  report.json  the numbers: the speedup table as `evaluation.speedup --json` prints it, the equality
               reports as `evaluation.equal --json`, acceptance, cost model, plans and caveats.
Sections (stable headings, so that a README can quote a table and a test can check it): Setup (model,
data, dtype, device, threads, versions, commit, dates and the commands, rebuilt from the run headers),
Speedup, Equality, Acceptance by depth and rank, Cost model (with the plan each =auto method chose),
Plots, Caveats. Every number comes from evaluation.analysis, speedup, equal, steps and plots: the
report adds no math of its own.
"""

from __future__ import annotations

import argparse
import base64
import functools
import html
import json
import math
import re
import shlex
import sys
from pathlib import Path
from typing import Callable, Iterable, Sequence

import pandas as pd
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import HydraException
from markdown_it import MarkdownIt
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from evaluation import equal, plots, speedup, steps
from evaluation.analysis import (CHECKED, OVERALL, RATIOS, UNKNOWN, Comparison, ResultError, Run, add_input_arguments,
                                 batch_table, comparisons_from_args, default_out_dir, rates, setup_name, summarize)
from methods.paths import resolve_path

FILES_DIR = "report_files"  # the PNGs of report.md, beside it
MAX_LISTED = 5  # mismatches, failed questions, ... listed per run; the rest are counted
CONF = Path(__file__).resolve().parent.parent / "conf"
GROUPS = ("model", "method", "data")  # config groups: a run names its choice (model=NAME), then overrides keys
RUN_KEYS = ("dir", "id")  # of the header's run_config: what the command needs to write the same file
_MISSING = object()
COMPOSE_ERRORS = (HydraException, OmegaConfBaseException, ValueError)  # a run's config no longer composes from conf/
_PLAIN = re.compile(r"[A-Za-z0-9_/\-+.:@%*?|]+")  # a Hydra override value that needs no quotes
_LITERAL = re.compile(r"[-+]?(\d[\d_]*\.?\d*([eE][-+]?\d+)?|\.\d+|inf|nan)|null|true|false", re.IGNORECASE)
CSS = """
body { font: 15px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; color: #1b1f24; background: #fff;
       max-width: 1180px; margin: 2em auto; padding: 0 1.2em; }
h1 { font-size: 1.7em; border-bottom: 2px solid #d0d7de; padding-bottom: .3em; }
h2 { font-size: 1.35em; border-bottom: 1px solid #d0d7de; padding-bottom: .2em; margin-top: 1.8em; }
h3 { font-size: 1.05em; margin-top: 1.4em; }
table { border-collapse: collapse; margin: .6em 0; font-size: 13px; display: block; overflow-x: auto; }
th, td { border: 1px solid #d0d7de; padding: 3px 8px; white-space: nowrap; }
th { background: #f3f5f7; }
tr:nth-child(even) td { background: #fafbfc; }
code { font: 12.5px ui-monospace, SFMono-Regular, Menlo, monospace; background: #f3f5f7; padding: 1px 4px;
       border-radius: 3px; }
pre { background: #f3f5f7; padding: .7em 1em; border-radius: 4px; white-space: pre-wrap; overflow-wrap: anywhere; }
pre code { padding: 0; background: none; }
img { max-width: 100%; height: auto; display: block; margin: .8em 0; }
li { margin: .2em 0; }
"""


def _code(text: str) -> str:
    """``text`` as a Markdown code span, whatever backticks it holds."""
    fence = "`" * (max((len(run) for run in re.findall(r"`+", text)), default=0) + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def _table(headers: Sequence[str], rows: list[list[str]], left: Sequence[bool]) -> str:
    """A Markdown table as evaluation.speedup draws them (a "|" in a cell escaped)."""
    return speedup.render_text(headers, [[c.replace("|", "\\|") for c in row] for row in rows], markdown=True,
                               left=left)


def _section_name(item: Run | Comparison) -> str | None:
    """The heading of the speedup table's section its rows are in: setup and platform (None for a run without a
    header; a comparison holding one has its baseline's)."""
    return None if item.setup is None else f"{setup_name(item.setup)} on {item.platform}"


def _runs(comparisons: Sequence[Comparison]) -> list[Run]:
    """Every run the comparisons hold (the baselines' included), each once, in order."""
    return list({id(r): r for c in comparisons for r in (c.run, *c.baselines)}.values())


def _distinct(values: Iterable[object]) -> str:
    found = [str(v) for v in dict.fromkeys(values) if v not in (None, "")]
    return ", ".join(found) if found else UNKNOWN


def _run_list(runs: Sequence[Run]) -> str:
    """"baseline (run 0), pld (runs 0, 1)"."""
    by_label: dict[str, list[int]] = {}
    for run in runs:
        by_label.setdefault(run.label, []).append(run.index)
    return ", ".join(f"{label} (run{'s' if len(ids) > 1 else ''} {', '.join(map(str, sorted(ids)))})"
                     for label, ids in by_label.items())


# ----------------------------------------------------------------------------------------------- commands


def _leaves(tree: dict, prefix: str = "") -> dict[str, object]:
    """A nested config as dotted keys (``method.tree``) and leaf values."""
    out: dict[str, object] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out |= _leaves(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = value
    return out


def _value(value: object) -> str:
    """A value as Hydra's override grammar reads it back."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, list):
        return "[" + ",".join(_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{_value(v)}" for k, v in value.items()) + "}"
    text = str(value)
    if _PLAIN.fullmatch(text) and not _LITERAL.fullmatch(text):
        return text
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


@functools.lru_cache(maxsize=None)
def _defaults(overrides: tuple[str, ...]) -> tuple[dict, dict]:
    """conf/config.yaml composed with ``overrides``: its leaves resolved, and as written (interpolations kept)."""
    def composed() -> object:
        return compose("config", overrides=list(overrides))

    if GlobalHydra.instance().is_initialized():  # inside a Hydra app or test: its config dir is this one
        cfg = composed()
    else:
        with initialize_config_dir(config_dir=str(CONF), version_base=None):
            cfg = composed()
    return _leaves(OmegaConf.to_container(cfg, resolve=True)), _leaves(OmegaConf.to_container(cfg, resolve=False))


def run_overrides(meta: dict) -> list[str]:
    """The Hydra overrides that recompose a run's recorded config: its choice in each config group
    (model=, method=, data=), then every key whose value differs from what that composes to today.

    Keys the defaults interpolate (a method's label) are left out where the other overrides already
    reproduce them. A group choice that conf/ lacks (a model config made for a test) is left to the defaults,
    and every key of it that differs is overridden.
    """
    config = dict(meta["config"])
    run = {k: v for k, v in (meta.get("run_config") or {}).items() if k in RUN_KEYS}
    if run:
        config["run"] = run
    recorded = _leaves(config)
    choices = [f"{group}={config[group]['name']}" for group in GROUPS  # a choice conf/ lacks: every key overridden
               if isinstance(config.get(group), dict)
               and (CONF / group / f"{config[group].get('name')}.yaml").is_file()]

    def differing(defaults: dict, skip: Callable[[str], bool]) -> list[str]:
        return [f"{'' if key in defaults else '+'}{key}={_value(value)}" for key, value in recorded.items()
                if defaults.get(key, _MISSING) != value and not skip(key)]

    resolved, raw = _defaults(tuple(choices))
    first = differing(resolved, lambda key: isinstance(raw.get(key), str) and "${" in raw[key])
    resolved, _ = _defaults(tuple(choices + first))
    return choices + first + [o for o in differing(resolved, lambda key: False) if o not in first]


def _order(others: dict[str, list[str]]) -> list[str]:
    """The methods list of an interleaved run in its order, from each run's ``interleaved_with`` (the others,
    in order)."""
    for label, rest in others.items():
        for i in range(len(rest) + 1):
            candidate = [*rest[:i], label, *rest[i:]]
            if all([m for m in candidate if m != mine] == theirs for mine, theirs in others.items()):
                return candidate
    return sorted({label for label, rest in others.items() for label in (label, *rest)})


def _quote(overrides: Iterable[str]) -> str:
    return " ".join(shlex.quote(o) for o in overrides)


def _interleave_command(runs: list[Run]) -> str:
    """The `evaluation.interleave` command of runs answered in turn: the shared overrides, and one methods entry
    (NAME:key=value,...) per method in its order; a method whose result file is not among the inputs is named in a
    comment."""
    order = _order({r.label: list(r.meta.get("interleaved_with") or ()) for r in runs})
    by_label = {r.label: r for r in runs}
    entries, shared = [], []
    for label in (label for label in order if label in by_label):
        meta = by_label[label].meta
        overrides = run_overrides(meta)
        shared = shared or [o for o in overrides if not re.match(r"\+?method[.=]", o)]
        options = [o.lstrip("+").removeprefix("method.") for o in overrides
                   if re.match(r"\+?method\.", o) and not o.startswith("method.name=")]
        entries.append(meta["method"] + (":" + ",".join(options) if options else ""))
    methods = "methods=[" + ",".join(f'"{e}"' for e in entries) + "]"
    missing = [label for label in order if label not in by_label]
    note = f"  # also in turn, no result file here: {', '.join(missing)}" if missing else ""
    return f"python -m evaluation.interleave {_quote([*shared[:1], methods, *shared[1:]])}{note}"


def commands(runs: Sequence[Run]) -> list[str]:
    """The commands that made ``runs``, rebuilt from their headers: one `evaluation.interleave` per set of
    methods answered in turn, one `evaluation.run` per other run (repeats merged into a -m sweep over run.id)."""
    interleaved: dict[tuple, list[Run]] = {}
    single: dict[str, list[int]] = {}
    out: list[str] = []
    for run in runs:
        if run.meta is None:
            continue
        if "config" not in run.meta:
            out.append(f"# {run.label} run {run.index}: not recorded (its header predates the config)")
        elif run.meta.get("interleaved_with"):
            key = (frozenset([run.label, *run.meta["interleaved_with"]]), run.index)
            interleaved.setdefault(key, []).append(run)
        else:
            try:
                overrides = run_overrides(run.meta)
            except COMPOSE_ERRORS as err:  # conf/ changed since the run: say so, keep the report
                out.append(f"# {run.label} run {run.index}: cannot rebuild its command from conf/ "
                           f"({str(err).splitlines()[0]})")
                continue
            rest = _quote(o for o in overrides if not o.startswith("run.id="))
            single.setdefault(rest, []).append(run.index)
    for members in interleaved.values():
        try:
            out.append(_interleave_command(members))
        except COMPOSE_ERRORS as err:
            out.append(f"# {_run_list(members)}: cannot rebuild the command from conf/ ({str(err).splitlines()[0]})")
    for rest, ids in single.items():
        ids = sorted(set(ids))
        if len(ids) > 1:
            out.append(f"python -m evaluation.run -m {rest} run.id={','.join(map(str, ids))}")
        else:
            out.append(f"python -m evaluation.run {rest}" + (f" run.id={ids[0]}" if ids[0] else ""))
    return out


# ------------------------------------------------------------------------------------------------- sections


def _setup(name: str, runs: list[Run]) -> dict:
    """What the headers of one section's runs say (distinct values joined), and the commands that made them."""
    metas = [r.meta for r in runs]
    versions = [m.get("versions") or {} for m in metas]
    commits = [f"{m['git_commit'][:12]}{' (dirty)' if m.get('git_dirty') else ''}" if m.get("git_commit") else None
               for m in metas]
    dates = sorted(str(d) for m in metas for d in (m.get("started"), *(m.get("resumed") or ())) if d)
    return {
        "section": name,
        "model": _distinct(f"{m.get('model')} ({m['model_id']})" if m.get("model_id") else m.get("model")
                           for m in metas),
        "data": _distinct(f"{m.get('data')}, {len(m.get('question_ids') or ())} questions, max_new_tokens "
                          f"{m.get('max_new_tokens')}" for m in metas),
        "dtype": _distinct(m.get("dtype") for m in metas),
        "device": _distinct(f"{m.get('device')} ({m.get('device_name', UNKNOWN)})" for m in metas),
        "cpu": _distinct(m.get("cpu") for m in metas),
        "threads": _distinct(m.get("torch_threads") for m in metas),
        "versions": _distinct(f"torch {v.get('torch', UNKNOWN)}, transformers {v.get('transformers', UNKNOWN)}"
                              for v in versions),
        "python": _distinct(m.get("python") for m in metas),
        "git commit": _distinct(commits),
        "date": f"{dates[0]} to {dates[-1]}" if len(set(dates)) > 1 else dates[0] if dates else UNKNOWN,
        "runs": _run_list(runs),
        "commands": commands(runs),
    }


def setups(comparisons: Sequence[Comparison]) -> list[dict]:
    """Per setup and platform (the speedup table's sections): what the run headers say, and the commands."""
    groups: dict[str, list[Run]] = {}
    for run in _runs(comparisons):
        if not run.foreign:
            groups.setdefault(_section_name(run), []).append(run)
    return [_setup(name, runs) for name, runs in groups.items()]


def _setup_markdown(items: list[dict], foreign: list[Run]) -> str:
    parts = []
    for item in items:
        facts = "\n".join(f"- {key}: {value}" for key, value in item.items() if key not in ("section", "commands"))
        parts.append(f"### {item['section']}\n\n{facts}\n\nCommands (rebuilt from the run headers):\n\n```sh\n"
                     + "\n".join(item["commands"] or ["# none recorded"]) + "\n```")
    if foreign:
        parts.append("Files without a run header (no .meta.json: setup and provenance unknown): "
                     + ", ".join(_code(r.path.name) for r in foreign))
    return "\n\n".join(parts)


EQUALITY_COLUMNS = ("Method", "Run", "Baseline", "Identical answers", "Identical turns", "Mismatched turns",
                    "Missing", "Failed", "Equal")


def _summary_markdown(table: pd.DataFrame, pairs: list[tuple[Comparison, equal.EqualityReport]]) -> str:
    """Per setup, one row per method over all its questions (the Overall rows of the speedup table) and how many of
    its turns equal the baseline's: the table a README or a paper quotes (docs/results/<name>/report.md)."""
    turns: dict[str, list[int]] = {}
    for comparison, report in pairs:
        done = turns.setdefault(report.label, [0, 0])
        done[0], done[1] = done[0] + report.n_identical_turns, done[1] + report.n_turns
    headers = ["Method", "Speedup", "MAT", "Tok/s", "Decode speedup", "Turns equal to the baseline"]
    out = []
    for name, part in speedup.sections(table):
        rows = []
        for _, row in part.loc[part["group"] == OVERALL].iterrows():
            same = turns.get(row["label"])
            rows.append([str(row["label"]), speedup.number(row["speedup"], 2), speedup.number(row["mat"], 2),
                         speedup.number(row["tokens_per_s"], 1), speedup.number(row["decode_speedup"], 2),
                         "(the baseline)" if row["reference"] else f"{same[0]}/{same[1]}" if same else "n/a"])
        out.append(f"### {name}\n\n" + _table(headers, rows, [True, False, False, False, False, False]))
    return "\n\n".join(out)


def _equality_markdown(pairs: list[tuple[Comparison, equal.EqualityReport]]) -> str:
    if not pairs:
        return "Nothing to check: no run besides the baselines' reference runs."
    unit = {False: "token", True: "character"}
    sections: dict[str, list[tuple[Comparison, equal.EqualityReport]]] = {}
    for c, r in pairs:
        sections.setdefault(_section_name(c), []).append((c, r))
    out = []
    for name, part in sections.items():
        rows = [[r.label + ("*" if r.provenance != CHECKED else ""), str(r.run),
                 f"{r.baseline_label} run {r.baseline_run}",
                 f"{r.n_identical}/{r.n_questions}", f"{r.n_identical_turns}/{r.n_turns}", str(len(r.mismatches)),
                 str(len(r.missing)), str(len(r.errors)), "yes" if r.ok else "no"] for _, r in part]
        notes = ["each run's answers against its baseline's reference run, token by token (output_ids); Identical: "
                 "answers (all turns) and turns equal to the baseline's; Missing / Failed: questions absent from "
                 "either file, or that failed in either"]
        for _, r in part:
            where = f"{r.label} run {r.run}"
            if r.by_text:
                notes.append(f"{where}: compared by text (a file has no output_ids)")
            notes += [f"{where}: question {m.question_id}, turn {m.turn}, first divergent {unit[r.by_text]} "
                      f"{m.index}: {r.baseline_label} {_code(m.baseline)}, {r.label} {_code(m.method)}"
                      for m in r.mismatches[:MAX_LISTED]]
            notes += [f"{where}: {text}" for text in (*r.missing, *r.errors)[:MAX_LISTED]]
            hidden = max(0, len(r.mismatches) - MAX_LISTED) + max(0, len(r.missing) + len(r.errors) - MAX_LISTED)
            if hidden:
                notes.append(f"{where}: {hidden} more (python -m evaluation.equal lists all)")
        table = _table(EQUALITY_COLUMNS, rows, [True, False, True, False, False, False, False, False, True])
        out.append(f"### {name}\n\n{table}\n\n" + "\n".join(f"- {n}" for n in notes))
    return f"{equal.summarize(pairs)}.\n\n" + "\n\n".join(out)


def _context(buckets: list[dict], i: int) -> str:
    low = buckets[i - 1]["below"] if i else 0
    high = buckets[i]["below"]
    if len(buckets) == 1:
        return "all"
    if high is None:
        return f"≥ {low}"
    return f"< {high}" if not low else f"{low}–{high - 1}"


def _choice(bucket: dict) -> str:
    """What a plan's bucket verifies: a tree's nodes and widths, or a policy's option per match class."""
    if "by_class" in bucket:
        return "; ".join(f"match {cls}: {option}" for cls, option in bucket["by_class"].items())
    if not bucket.get("nodes"):
        return "no draft"
    widths = bucket.get("widths") or ()
    shape = "a chain" if widths and set(widths) == {1} else f"widths {'-'.join(map(str, widths))}"
    text = f"{bucket['nodes']} nodes, {shape}"
    rate = bucket.get("draft_rate", 1.0)
    return text + (f", drafts {rate:.0%} of steps" if rate < 1 else "")


def plans(comparisons: Sequence[Comparison]) -> list[dict]:
    """The plan or policy each =auto method chose (its run header's ``drafter.plan`` / ``drafter.policy``, or its
    fallback's ``drafter.aux.plan``), one entry per distinct plan with the runs that used it."""
    found: dict[tuple, dict] = {}
    for run in _runs(comparisons):
        drafter = (run.meta or {}).get("drafter") or {}
        for where, part in (("", drafter), ("aux.", drafter.get("aux"))):
            for kind in ("plan", "policy"):
                plan = part.get(kind) if isinstance(part, dict) else None
                if not isinstance(plan, dict) or not plan.get("buckets"):
                    continue
                key = (_section_name(run), run.label, where + kind, json.dumps(plan["buckets"], sort_keys=True))
                entry = found.setdefault(key, {"section": key[0], "label": run.label, "kind": where + kind, "runs": [],
                                               "buckets": plan["buckets"], "sources": plan.get("sources") or {}})
                entry["runs"].append(run.index)
    return list(found.values())


PLAN_COLUMNS = ("Method", "Runs", "Plan", "Context", "Chosen", "Exp. tokens", "Pred. speedup", "Pred. tok/s")


def plan_changes(comparisons: Sequence[Comparison]) -> list[dict]:
    """Per method, how often its drafter changed plan during the runs (``drafter_stats[].plan_changes``), where
    its records hold them."""
    totals: dict[tuple, dict] = {}
    for c in comparisons:
        counts = c.run.frame["plan_changes"].dropna()
        if not counts.empty:
            entry = totals.setdefault((_section_name(c), c.run.label), {
                "section": _section_name(c), "label": c.run.label, "changes": 0, "runs": 0, "questions": 0})
            entry["changes"] += int(counts.sum())
            entry["runs"] += 1
            entry["questions"] += len(counts)
    return list(totals.values())


def _plans_markdown(found: list[dict], changes: list[dict]) -> str:
    if not found and not changes:
        return ""
    out = []
    for name in dict.fromkeys([p["section"] for p in found] + [c["section"] for c in changes]):
        mine = [p for p in found if p["section"] == name]
        rows = [[p["label"], ", ".join(map(str, sorted(p["runs"]))), p["kind"], _context(p["buckets"], i), _choice(b),
                 speedup.number(b.get("expected_tokens"), 2), speedup.number(b.get("predicted_speedup"), 2),
                 speedup.number(b.get("predicted_tokens_per_s"), 1)]
                for p in mine for i, b in enumerate(p["buckets"])]
        notes = ["the tree or policy each =auto method chose for this machine, per context length (tokens before the "
                 "step): Exp. tokens per step, Pred. speedup and tok/s as its planner predicted them"]
        for p in mine:
            used = [f"{key} {Path(value).name}" if isinstance(value, str) else f"{key} {'yes' if value else 'no'}"
                    if isinstance(value, bool) else f"{key} {value}" for key, value in p["sources"].items()]
            if used:
                notes.append(f"{p['label']} {p['kind']} made from: {'; '.join(used)}")
        notes += [f"{c['label']}: {c['changes']} plan changes over {c['questions']} questions ({c['runs']} "
                  f"run{'s' if c['runs'] > 1 else ''})"
                  for c in changes if c["section"] == name]
        table = _table(PLAN_COLUMNS, rows, [True, True, True, True, True, False, False, False]) + "\n\n" if rows else ""
        out.append(f"### Plans chosen ({name})\n\n{table}" + "\n".join(f"- {n}" for n in notes))
    return "\n\n".join(out)


# -------------------------------------------------------------------------------------------------- caveats


def _drift_between_runs(comparisons: Sequence[Comparison], ratio: str) -> list[dict]:
    """Where a baseline has 2+ runs: its last run's tokens/s over its first's, on the questions both answered."""
    out, seen = [], set()
    for c in comparisons:
        key = frozenset(id(b) for b in c.baselines)
        if len(c.baselines) < 2 or key in seen:
            continue
        seen.add(key)
        ordered = sorted(c.baselines, key=lambda b: (str((b.meta or {}).get("started", "")), b.index))
        first, last = ordered[0], ordered[-1]
        ids = first.ok_ids.intersection(last.ok_ids)
        before, after = (rates(r.frame.loc[ids], ratio)["tokens_per_s"] for r in (first, last))
        change = after / before if before else math.nan
        out.append({
            "kind": "drift_between_runs", "section": _section_name(c), "label": first.label,
            "first_run": first.index, "last_run": last.index, "n_questions": len(ids),
            "first_tokens_per_s": before, "last_tokens_per_s": after, "ratio": change,
            "text": f"drift between runs: {first.label} run {last.index} measured {change:.2f}x the tokens/s "
                    f"of its run {first.index} ({after:.1f} vs {before:.1f} tok/s on the same {len(ids)} questions); "
                    f"every speedup divides by the mean of its {len(ordered)} runs",
        })
    return out


def _drift_within_runs(comparisons: Sequence[Comparison], ratio: str) -> list[dict]:
    """Where methods answered the questions in turn with a baseline run: that run's tokens/s in the last tenth of
    its questions (in the order answered) over the first tenth."""
    partners: dict[int, tuple[Run, list[str]]] = {}
    for c in comparisons:
        if c.in_turn and not c.is_reference:
            for b in c.baselines:
                partners.setdefault(id(b), (b, []))[1].append(c.run.label)
    out = []
    for base, labels in partners.values():
        ids = list(base.ok_ids)
        if len(ids) < 2:
            continue
        k = max(1, round(len(ids) / 10))
        before, after = (rates(base.frame.loc[part], ratio)["tokens_per_s"] for part in (ids[:k], ids[-k:]))
        change = after / before if before else math.nan
        out.append({
            "kind": "drift_within_run", "section": _section_name(base), "label": base.label, "run": base.index,
            "n_questions": k, "first_tokens_per_s": before, "last_tokens_per_s": after, "ratio": change,
            "text": f"drift within a run: {base.label} run {base.index} ran its last tenth of questions ({k}) at "
                    f"{change:.2f}x the tokens/s of its first tenth ({after:.1f} vs {before:.1f} tok/s); "
                    f"{', '.join(dict.fromkeys(labels))} answered in turn with it and saw the same drift (the "
                    "questions differ too: part of the change is theirs)",
        })
    return out


def caveats(comparisons: Sequence[Comparison], table: pd.DataFrame,
            pairs: Sequence[tuple[Comparison, equal.EqualityReport]], notes: Sequence[str], ratio: str) -> list[dict]:
    """What the analysis knows to qualify the numbers: files left out, methods timed apart from their baseline,
    unchecked provenance (*), speedups within their spread of 1.0 (†), failed questions, unequal answers, drift."""
    out = [{"kind": "skipped", "section": None, "text": note} for note in notes]
    for name, part in speedup.sections(table):
        apart = speedup.timed_apart(part)
        if apart:
            out.append({"kind": "timed_apart", "section": name, "labels": apart,
                        "text": f"timed apart from the baseline (one run after another, so a drift in the machine's "
                                f"speed enters their speedup): {', '.join(apart)}"})
        out += [{"kind": "unchecked", "section": name, "labels": [label],
                 "text": f"{label}*: provenance {provenance}"} for label, provenance in speedup.unchecked(part)]
        out += [{"kind": "noisy", "section": name, "labels": [label],
                 "text": f"{label}, {group}: the {column.replace('_', ' ')}'s std over runs exceeds its distance from "
                         f"1.0 ({speedup.NOISY}); it cannot be told from no speedup"}
                for label, group, column in speedup.noisy_rows(part)]
    for run in _runs(comparisons):
        failed = run.frame["error"].dropna()
        if len(failed):
            listed = "; ".join(f"question {qid}: {error}" for qid, error in failed.head(MAX_LISTED).items())
            more = f"; and {len(failed) - MAX_LISTED} more" if len(failed) > MAX_LISTED else ""
            out.append({"kind": "errors", "section": _section_name(run),
                        "labels": [run.label], "questions": [int(q) for q in failed.index],
                        "text": f"{run.label} run {run.index}: {len(failed)} failed question"
                                f"{'s' if len(failed) > 1 else ''} ({listed}{more}), left out of its rows"})
    for c, r in pairs:
        if not r.ok:
            out.append({"kind": "unequal", "section": _section_name(c), "labels": [r.label],
                        "text": f"{r.label} run {r.run}: answers differ from {r.baseline_label} run {r.baseline_run} "
                                f"({len(r.mismatches)} mismatched turns, {len(r.missing)} missing and {len(r.errors)} "
                                "failed questions; see Equality)"})
    return out + _drift_between_runs(comparisons, ratio) + _drift_within_runs(comparisons, ratio)


def _caveats_markdown(found: list[dict], several: bool) -> str:
    if not found:
        return "None found."
    return "\n".join(f"- {c['text']}" + (f" [{c['section']}]" if several and c.get("section") else "") for c in found)


# ---------------------------------------------------------------------------------------------------- build


def _steps_markdown(accepted: pd.DataFrame, cost: pd.DataFrame, drafted: pd.DataFrame) -> tuple[str, str]:
    empty = pd.DataFrame()
    acceptance = speedup.format_steps(accepted, empty, "md", drafted).strip() or (
        "No per-step records: no method drafted, or the result files predate them.")
    cost_text = speedup.format_steps(empty, cost, "md").strip() or (
        "No per-step records: the result files predate them, or hold only the baseline.")
    return acceptance, cost_text


def build(comparisons: Sequence[Comparison], notes: Sequence[str], title: str, files_dir: Path,
          ratio: str = "mean", calibration: Path | None = None,
          decoder_factory: Callable[[dict | None], equal.Decoder] = equal.tokenizer_decoder
          ) -> tuple[str, dict, list[Path]]:
    """The report's Markdown, its JSON and the plots it drew (PNGs under ``files_dir``)."""
    table = summarize(comparisons, ratio)
    pairs = equal.check(comparisons, decoder_factory)
    accepted = steps.acceptance(comparisons)
    cost = steps.cost_model(comparisons, calibration or resolve_path("results/calibration"))
    batch = speedup.format_batch(batch_table(table), "md",
                                 steps.batch_prediction(comparisons, calibration or resolve_path("results/calibration")))
    drafted = steps.sources(comparisons)
    setup = setups(comparisons)
    chosen, changes = plans(comparisons), plan_changes(comparisons)
    found = caveats(comparisons, table, pairs, notes, ratio)
    images = []
    figures = []
    for stem, caption, fig in plots.figures(table, comparisons):
        images += plots.save(fig, files_dir, stem, ("png",))
        figures.append(f"![{caption.replace(chr(10), ': ')}]({files_dir.name}/{stem}.png)")
    acceptance, cost_text = _steps_markdown(accepted, cost, drafted)
    plan_text = _plans_markdown(chosen, changes)
    foreign = [r for r in _runs(comparisons) if r.foreign]
    several = len(speedup.sections(table)) > 1
    markdown = "\n\n".join([
        f"# draftbench report: {title}",
        f"From {len(_runs(comparisons))} result files by `python -m evaluation.report`; the numbers are those of "
        "`evaluation.speedup`, `evaluation.equal` and `evaluation.steps` on the same files (their definitions: "
        "`python -m evaluation.speedup --help`).",
        "## Summary", _summary_markdown(table, pairs),
        "## Setup", _setup_markdown(setup, foreign),
        "## Speedup", speedup.format_table(table, "md").strip(),
        *(["## By batch size", batch.strip()] if batch else []),
        "## Equality", _equality_markdown(pairs),
        "## Acceptance by depth and rank", acceptance,
        "## Cost model", cost_text + ("\n\n" + plan_text if plan_text else ""),
        "## Plots", "\n\n".join(figures) or "No plots.",
        "## Caveats", _caveats_markdown(found, several),
    ]) + "\n"
    data = {
        "title": title, "files": [str(r.path) for r in _runs(comparisons)], "setups": setup,
        "speedup": speedup.records(table), "equality": equal.records(pairs),
        "equality_summary": equal.summarize(pairs), "acceptance": speedup.records(accepted),
        "cost_model": speedup.records(cost), "sources": speedup.records(drafted), "plans": chosen,
        "plan_changes": changes, "plots": [f"{files_dir.name}/{p.name}" for p in images], "caveats": found,
    }
    return markdown, data, images


def to_html(markdown: str, title: str, base: Path) -> str:
    """One self-contained page: the Markdown rendered (raw HTML in it escaped), images inline as data URIs,
    CSS inline, no script."""
    md = MarkdownIt("commonmark", {"html": False}).enable("table")
    tokens = md.parse(markdown)
    for token in tokens:
        for child in token.children or ():
            if child.type == "image":
                path = base / str(child.attrGet("src"))
                mime = "image/svg+xml" if path.suffix == ".svg" else "image/png"
                child.attrSet("src", f"data:{mime};base64,{base64.b64encode(path.read_bytes()).decode()}")
    body = md.renderer.render(tokens, md.options, {})
    return (f'<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">\n'
            f"<title>{html.escape(title)}</title>\n<style>{CSS}</style>\n</head>\n<body>\n{body}</body>\n</html>\n")


def _json_ready(value: object) -> object:
    """NaN (n/a) as null, as the speedup table's records have it: report.json stays strict JSON."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _json_ready(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_ready(v) for v in value]
    return value


def write(comparisons: Sequence[Comparison], notes: Sequence[str], out_dir: Path, title: str, ratio: str = "mean",
          calibration: Path | None = None,
          decoder_factory: Callable[[dict | None], equal.Decoder] = equal.tokenizer_decoder) -> list[Path]:
    """report.md, report.html and report.json under ``out_dir``, the PNGs in its report_files/ (PNGs of an
    earlier report there are removed); returns the paths written."""
    files_dir = out_dir / FILES_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in files_dir.glob("*.png"):
        old.unlink()
    markdown, data, images = build(comparisons, notes, title, files_dir, ratio, calibration, decoder_factory)
    paths = [out_dir / f"report.{ext}" for ext in ("md", "html", "json")]
    paths[0].write_text(markdown, encoding="utf-8")
    paths[1].write_text(to_html(markdown, f"draftbench report: {title}", out_dir), encoding="utf-8")
    paths[2].write_text(json.dumps(_json_ready(data), indent=1, ensure_ascii=False, allow_nan=False) + "\n",
                        encoding="utf-8")
    return paths + images


def main(argv: Sequence[str] | None = None,
         decoder_factory: Callable[[dict | None], equal.Decoder] = equal.tokenizer_decoder) -> int:
    parser = argparse.ArgumentParser(prog="python -m evaluation.report", description=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_input_arguments(parser)
    parser.add_argument("--out", type=Path, metavar="DIR",
                        help="where to write the report (default: the results folder named)")
    parser.add_argument("--ratio", choices=RATIOS, default="mean", help="speedup definition (see evaluation.speedup)")
    parser.add_argument("--calibration", type=Path, default=Path("results/calibration"), metavar="DIR",
                        help="where device calibrations are, for the cost model (default: results/calibration)")
    args = parser.parse_args(argv)
    try:
        comparisons, notes = comparisons_from_args(args)
        paths = write(comparisons, notes, args.out or default_out_dir(args.paths), " ".join(map(str, args.paths)),
                      args.ratio, resolve_path(args.calibration), decoder_factory)
    except ResultError as err:
        print(f"report: error: {err}", file=sys.stderr)
        return 2
    for note in notes:
        print(f"report: {note}", file=sys.stderr)
    print("\n".join(map(str, paths)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
