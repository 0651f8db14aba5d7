"""Plots of a benchmark: speedup per category group, MAT vs speedup, accepted lengths, acceptance by depth/rank, speedup
against the batch size.

    python -m evaluation.plots [PATH ...] [--out DIR]

Writes PNG and SVG files (one set per setup, suffixed with the setup when there are several).
Figures are drawn on the Agg canvas without pyplot, so they work headless and in notebooks alike.
"""

from __future__ import annotations

import argparse
import re
import textwrap
import sys
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from evaluation import steps
from evaluation.analysis import (OVERALL, RATIOS, SETUP_KEYS, Comparison, ResultError, add_input_arguments,
                                 batch_table, comparisons_from_args, default_out_dir, setup_name, summarize)
from evaluation.categories import group_order


def _figure(width: float, height: float, ncols: int = 1) -> tuple[Figure, object]:
    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig, fig.subplots(1, ncols) if ncols > 1 else fig.add_subplot()


def _title(fig: Figure, text: str) -> None:
    """A figure title wrapped to the figure's width (a long setup name must not run off the right edge)."""
    chars = int(fig.get_figwidth() * 10)  # about ten characters per inch at the default title size
    fig.suptitle("\n".join(textwrap.fill(line, chars) for line in text.split("\n")))


def _colors(labels: Sequence[str]) -> dict[str, str]:
    """A colour per label by sorted order, so a method looks the same in every plot of a setup."""
    return {label: f"C{i % 10}" for i, label in enumerate(sorted(set(labels)))}


def _empty(ax: object, message: str) -> None:
    ax.text(0.5, 0.5, message, ha="center", va="center", transform=ax.transAxes)
    ax.set_axis_off()


def _methods(table: pd.DataFrame) -> pd.DataFrame:
    """The rows of methods proper (the baseline's own rows only measure noise)."""
    return table[~table["reference"]]


def speedup_by_group(table: pd.DataFrame, title: str = "") -> Figure:
    """Grouped bars: speedup per category group, one bar per method, error bars = std over runs."""
    rows = _methods(table)
    groups = [group for group in group_order() if group in set(rows["group"])]
    labels = sorted(set(rows["label"]))
    colors = _colors(labels)
    fig, ax = _figure(max(6.0, 1.1 * len(groups) * max(1, len(labels)) ** 0.5), 4.0)
    if rows.empty:
        _empty(ax, "no method runs besides the baseline")
        return fig
    width = 0.8 / len(labels)
    for i, label in enumerate(labels):
        part = rows[rows["label"] == label].set_index("group").reindex(groups)
        err = part["speedup_std"].where(part["n_runs"] > 1).fillna(0).to_numpy()
        ax.bar(np.arange(len(groups)) + (i - (len(labels) - 1) / 2) * width, part["speedup"], width,
               yerr=err if err.any() else None, capsize=3, label=label, color=colors[label])
    ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    ax.set_xticks(np.arange(len(groups)), groups)
    ax.set_ylabel(f"speedup over {', '.join(dict.fromkeys(rows['baseline']))}")
    _title(fig, title or "Speedup per category group")
    ax.legend(frameon=False)
    return fig


def mat_vs_speedup(table: pd.DataFrame, title: str = "") -> Figure:
    """Overall MAT against speedup: the gap below speedup = MAT is what verification costs."""
    rows = _methods(table)
    rows = rows[(rows["group"] == OVERALL) & rows["mat"].notna()]
    colors = _colors(_methods(table)["label"])
    fig, ax = _figure(5.5, 4.5)
    if rows.empty:
        _empty(ax, "no method runs with accept lengths")
        return fig
    for row in rows.itertuples():
        repeated = row.n_runs > 1
        ax.errorbar(row.mat, row.speedup, xerr=row.mat_std if repeated else None,
                    yerr=row.speedup_std if repeated else None, fmt="o", capsize=3, color=colors[row.label],
                    label=row.label)
    top = max(rows["mat"].max(), rows["speedup"].max()) * 1.1
    ax.plot([1, top], [1, top], color="grey", linestyle="--", linewidth=0.8, label="speedup = MAT (free verification)")
    ax.set_xlabel("MAT (mean accepted tokens per forward)")
    ax.set_ylabel("speedup (Overall)")
    _title(fig, title or "MAT vs speedup")
    ax.legend(frameon=False, fontsize="small")
    return fig


def accept_length_hist(comparisons: Sequence[Comparison], title: str = "") -> Figure:
    """Share of decode forwards by accepted tokens (bonus included), per method, over all its runs."""
    pooled: dict[str, list[int]] = {}
    for c in comparisons:
        if not c.is_reference:
            frame = c.run.frame.loc[c.run.ok_ids]
            pooled.setdefault(c.run.label, []).extend(a for lengths in frame["accept_lengths"] for a in lengths)
    colors = _colors(pooled)
    pooled = {label: pooled[label] for label in sorted(pooled) if pooled[label]}
    fig, ax = _figure(6.5, 4.0)
    if not pooled:
        _empty(ax, "no method runs with accept lengths")
        return fig
    top = max(max(lengths) for lengths in pooled.values())
    ax.hist(list(pooled.values()), bins=np.arange(0.5, top + 1.5), density=True, label=list(pooled),
            color=[colors[label] for label in pooled])
    ax.set_xlabel("accepted tokens per decode forward (bonus included)")
    ax.set_ylabel("share of forwards")
    _title(fig, title or "Accepted length per step")
    ax.legend(frameon=False)
    return fig


def acceptance_plot(accepted: pd.DataFrame, title: str = "") -> Figure:
    """Acceptance by depth (share of drafting steps reaching depth d) and by rank at depth 1, per method."""
    fig, (by_depth, by_rank) = _figure(10.0, 4.2, ncols=2)
    if accepted.empty:
        _empty(by_depth, "no method drafted (or the result files predate per-step records)")
        by_rank.set_axis_off()
        return fig
    colors = _colors(accepted["label"])
    depths = [c for c in accepted.columns if c.startswith("d") and c[1:].isdigit()]
    ranks = [c for c in accepted.columns if c.startswith("r") and c[1:].isdigit()]
    width = 0.8 / len(accepted)
    for i, row in enumerate(accepted.sort_values("label").itertuples()):
        values = accepted.loc[row.Index]
        by_depth.plot(range(1, len(depths) + 1), values[depths].astype(float), marker="o", color=colors[row.label],
                      label=row.label)
        by_rank.bar(np.arange(len(ranks)) + (i - (len(accepted) - 1) / 2) * width, values[ranks].astype(float),
                    width, color=colors[row.label], label=row.label)
    by_depth.set_xlabel("depth d")
    by_depth.set_ylabel("share of drafting steps accepting depth >= d")
    by_depth.set_ylim(0, 1)
    by_rank.set_xticks(np.arange(len(ranks)), [c[1:] for c in ranks])
    by_rank.set_xlabel("rank of the accepted depth-1 node among its siblings")
    by_rank.set_ylabel("share of drafting steps")
    by_depth.legend(frameon=False, fontsize="small")
    _title(fig, title or "Acceptance by depth and rank")
    return fig


FORMATS = ("png", "svg")
def batch_speedup(batch: pd.DataFrame, title: str = "") -> Figure:
    """Against the batch size, one line per method: its speedup over the baseline at the same batch size (left) and
    the tokens per second the machine serves (right, the baselines too). ``batch``: analysis.batch_table's rows."""
    fig, (left, right) = _figure(10.0, 4.0, ncols=2)
    colors = _colors(batch["series"])
    for series, part in batch.groupby("series", sort=True):
        part = part.sort_values("batch_size")
        if not part["reference"].all():
            left.plot(part["batch_size"], part["speedup"], marker="o", label=series, color=colors[series])
        right.plot(part["batch_size"], part["total_tokens_per_s"], marker="o", label=series, color=colors[series],
                   linestyle="--" if part["reference"].all() else "-")
    left.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted(set(batch["batch_size"])), [str(b) for b in sorted(set(batch["batch_size"]))])
        ax.set_xlabel("batch size")
        ax.legend(frameon=False, fontsize="small")
    left.set_ylabel("speedup over the baseline at the same batch size")
    right.set_ylabel("total tokens/s (all rows)")
    _title(fig, title or "Speedup against the batch size")
    return fig


TITLES = {"speedup_by_group": "Speedup per category group", "mat_vs_speedup": "MAT vs speedup",
          "accept_lengths": "Accepted length per step", "acceptance": "Acceptance by depth and rank",
          "batch_speedup": "Speedup against the batch size"}


def save(fig: Figure, out_dir: Path, name: str, formats: Sequence[str] = FORMATS) -> list[Path]:
    """``name``.png and/or ``name``.svg under ``out_dir`` (the SVG without a date, so reruns are byte-stable)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / f"{name}.{ext}" for ext in formats]
    for path in paths:
        fig.savefig(path, **({"dpi": 150} if path.suffix == ".png" else {"metadata": {"Date": None}}))
    return paths


def figures(table: pd.DataFrame, comparisons: Sequence[Comparison]) -> Iterator[tuple[str, str, Figure]]:
    """(file stem, title, figure) of every plot for every setup in ``table``; the stem is suffixed with the
    setup when there are several."""
    setups = list(table.groupby(list(SETUP_KEYS), sort=False))
    for setup, part in setups:
        name = setup_name(setup)
        suffix = "" if len(setups) == 1 else "-" + re.sub(r"[^A-Za-z0-9.]+", "_", "-".join(setup))
        mine = [c for c in comparisons if c.setup == tuple(setup)]
        accepted = steps.acceptance(mine)
        draw = {"speedup_by_group": lambda title: speedup_by_group(part, title),
                "mat_vs_speedup": lambda title: mat_vs_speedup(part, title),
                "accept_lengths": lambda title: accept_length_hist(mine, title)}
        if not accepted.empty:
            draw["acceptance"] = lambda title: acceptance_plot(accepted, title)
        batch = batch_table(part)
        if not batch.empty:
            draw["batch_speedup"] = lambda title: batch_speedup(batch, title)
        for stem, plot in draw.items():
            title = f"{TITLES[stem]}\n{name}"
            yield stem + suffix, title, plot(title)


def plot_all(table: pd.DataFrame, comparisons: Sequence[Comparison], out_dir: Path,
             formats: Sequence[str] = FORMATS) -> list[Path]:
    """Every plot for every setup in ``table``."""
    return [path for stem, _, fig in figures(table, comparisons) for path in save(fig, out_dir, stem, formats)]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m evaluation.plots", description=__doc__.split("\n\n")[0])
    add_input_arguments(parser)
    parser.add_argument("--ratio", choices=RATIOS, default="mean", help="speedup definition (see evaluation.speedup)")
    parser.add_argument("--out", type=Path, metavar="DIR",
                        help="where to write the plots (default: the results folder)")
    args = parser.parse_args(argv)
    try:
        comparisons, notes = comparisons_from_args(args)
        table = summarize(comparisons, args.ratio)
    except ResultError as err:
        print(f"plots: error: {err}", file=sys.stderr)
        return 2
    for note in notes:
        print(f"plots: {note}", file=sys.stderr)
    paths = plot_all(table, comparisons, args.out or default_out_dir(args.paths))
    print(f"plots: wrote {', '.join(map(str, paths))}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
