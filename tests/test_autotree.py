"""Hardware-aware trees: the tree search, the calibration and acceptance files, tree=auto end to end on a tiny model,
and the per-step analysis (acceptance by depth and rank, the cost-model check)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from evaluation import acceptance, analysis, calibrate, plots, speedup, steps, store
from evaluation.acceptance import collect, count
from evaluation.store import AcceptanceError, AutoTreeError, Calibration
from methods.costs import isotonic, smoother
from evaluation.run import run
from helpers import config, tiny_checkpoint
from methods.engine import Engine
from methods.recycling import TokenRecycling
from methods.tree import from_rank_paths, load_template
from methods.tree_search import DraftCost, NodeStats, best_tree, plan

from conftest import VOCAB

# a calibration of the tiny model in a few seconds: the sizes up to 16, two contexts, two rounds, no extra time
CAL = ["calibration.sizes=[1,2,4,8,16]", "calibration.contexts=[16,64]", "calibration.min_rounds=2",
       "calibration.budget_s=0"]
PROBS = {(0,): 0.5, (1,): 0.2, (0, 0): 0.3, (0, 1): 0.1, (1, 0): 0.05, (0, 0, 0): 0.15}


def linear(per_token: float):
    """A step costing 1 + per_token x (q - 1) (in seconds), whatever the context."""
    return lambda q, context=0: 1 + per_token * (q - 1)


def test_best_tree_of_n_nodes_is_the_n_most_accepted_and_closed_under_parents():
    stats = NodeStats(PROBS)
    free = best_tree(stats, linear(0.0))  # verification is free: take every node that was ever accepted
    assert set(free.paths) == set(PROBS) and free.expected_tokens == pytest.approx(1 + sum(PROBS.values()))
    assert free.paths == tuple(sorted(PROBS, key=lambda p: (len(p), p)))  # BFS order
    for per_token in (0.05, 0.1, 0.2):
        choice = best_tree(stats, linear(per_token))
        ranked = [p for p, _ in stats.ranked()][: choice.n_nodes]
        assert set(choice.paths) == set(ranked)
        assert all(p[:-1] in choice.paths for p in choice.paths if len(p) > 1)
        assert choice.tokens_per_s == pytest.approx(choice.expected_tokens / (1 + per_token * choice.n_nodes))
    assert best_tree(stats, linear(1.0)).paths == ()  # every node costs a whole step: no tree pays


def test_the_chosen_size_maximises_tokens_per_second():
    stats = NodeStats(PROBS)
    cost = linear(0.12)
    choice = best_tree(stats, cost)
    ranked = [p for _, p in stats.ranked()]
    speeds = [(1 + sum(ranked[:n])) / cost(n + 1) for n in range(len(ranked) + 1)]
    assert choice.n_nodes == max(range(len(speeds)), key=speeds.__getitem__)


def test_steps_without_a_draft_cost_a_single_token_step():
    stats = NodeStats({(0,): 0.8, (0, 0): 0.6}, draft_rate=0.5)
    choice = best_tree(stats, linear(0.1))
    assert choice.n_nodes == 2 and choice.draft_rate == 0.5
    assert choice.expected_tokens == pytest.approx(1 + 0.5 * 1.4)
    assert choice.step_ms == pytest.approx(1000 * (0.5 * 1.2 + 0.5 * 1.0))


def test_a_drafting_cost_per_depth_is_weighed_over_every_depth_limit():
    stats = NodeStats(PROBS)
    cost = linear(0.05)
    assert best_tree(stats, cost, draft=DraftCost(0.0, 0.0, 0.0)).paths == best_tree(stats, cost).paths
    draft = DraftCost(base=0.02, per_level=0.3, per_node=0.01)
    choice = best_tree(stats, cost, draft=draft)
    family = []  # every tree the search weighs: the n most-accepted nodes no deeper than each limit
    for limit in (1, 2, 3):
        ranked = [p for p, _ in stats.ranked() if len(p) <= limit]
        family += [ranked[:n] for n in range(1, len(ranked) + 1)]

    def speed(tree):
        depth, inner = max(map(len, tree)), len({p[:-1] for p in tree if len(p) > 1})
        return (1 + sum(PROBS[p] for p in tree)) / (cost(len(tree) + 1) + draft.seconds(depth, inner))

    best = max(family, key=speed)
    assert set(choice.paths) == set(best) and choice.tokens_per_s == pytest.approx(speed(best))
    assert max(map(len, choice.paths)) == 1 < max(map(len, best_tree(stats, cost).paths))  # a forward per depth: shallow
    assert choice.draft_ms == pytest.approx(1000 * draft.seconds(1, 0))


def test_drafting_calibration_fits_its_cost_and_interpolates_it_over_the_context():
    truth = {128: DraftCost(0.004, 0.002, 0.0001), 1024: DraftCost(0.006, 0.003, 0.0001)}
    trees = tuple((d, i) for d, i in [(1, 0), (2, 1), (2, 8), (4, 3), (4, 60), (8, 7), (8, 120)])
    cal = store.DraftingCalibration(key={}, method={}, contexts=(128, 1024), trees=trees, provenance={},
                                        draft_ms=tuple(tuple(1000 * truth[c].seconds(*t) for t in trees) for c in truth))
    for context, cost in truth.items():
        fitted = cal.cost(context)
        assert (fitted.base, fitted.per_level, fitted.per_node) == pytest.approx((cost.base, cost.per_level, cost.per_node))
    assert cal.cost(576).base == pytest.approx(0.005) and cal.cost(1920).base == pytest.approx(0.008)
    line = store.DraftingCalibration(key={}, method={}, contexts=(128,), trees=trees, provenance={},
                                         draft_ms=((0.0, 1.5, 1.5, 5.5, 5.5, 13.5, 13.5),))  # crosses zero: -0.5 ms
    fit = line.fitted[0]  # no negative term: the best fit with every cost >= 0
    assert fit.base == 0.0 and fit.per_node >= 0 and fit.per_level == pytest.approx(0.225 / 118, rel=1e-2)


def test_plan_shrinks_the_tree_as_the_context_makes_it_dearer_and_merges_equal_buckets():
    stats = NodeStats(PROBS)
    dearer = plan(stats, lambda c: lambda q: 1 + (q - 1) * c / 1000, contexts=[10, 100, 400, 4000])
    sizes = [c.n_nodes for c in dearer.choices]
    assert sizes == sorted(sizes, reverse=True) and sizes[-1] == 0
    assert len(dearer.bounds) == len(dearer.choices) - 1
    assert dearer.index(0) == 0 and dearer.index(10**6) == len(dearer.choices) - 1
    flat = plan(stats, lambda c: linear(0.01), contexts=[128, 512, 2048])
    assert len(flat.choices) == 1 and flat.bounds == ()


def test_sibling_ranks_are_the_template_ranks_of_the_wide_tree():
    """Acceptance statistics are keyed by sibling-rank paths: for the candidate trees they are the template paths."""
    for name in ("wide", "paper", "paper-b5", "paper-b4", "paper-b3", "chain6"):
        paths = sorted(map(tuple, load_template(name)), key=lambda p: (len(p), p))
        shape, ranks = from_rank_paths(paths)
        assert list(shape.sibling_ranks[1:]) == ranks.tolist(), name
        assert all(shape.sibling_ranks[i] == p[-1] for i, p in zip(range(1, shape.n_nodes), paths))


def test_the_engine_records_every_steps_accepted_ranks_and_block_size(llama):
    drafter = TokenRecycling(VOCAB, tree="paper-b4")
    engine = Engine(llama, eos_token_ids=set(), time_forward=True)
    prompt = [3, 4, 5, 3, 4, 5, 3, 4, 5, 3, 4]
    engine.generate(prompt, drafter, 40)  # hot start: the second generation accepts drafts
    gen = engine.generate(prompt, drafter, 40)
    shape = drafter.shape()
    assert len(gen.accept_paths) == len(gen.block_sizes) == gen.decoding_steps
    assert set(gen.block_sizes) == {shape.size}
    assert [len(p) + 1 for p in gen.accept_paths[:-1]] == gen.accept_lengths[:-1]
    assert len(gen.accept_paths[-1]) in (gen.accept_lengths[-1] - 1, gen.accept_lengths[-1])  # the budget may cut
    nodes = {tuple(shape.sibling_ranks[j] for j in path[1:]) for path in shape.paths}
    assert all(tuple(p) in nodes for p in gen.accept_paths) and max(gen.accept_lengths) > 1
    assert 0 < gen.forward_time <= gen.decode_time


def test_count_pools_accepted_prefixes_over_drafting_steps():
    records = [{"choices": [{"accept_paths": [[0, 1], [], [2]], "block_sizes": [5, 1, 5]}]}, {"error": {}}]
    nodes, steps_, drafting = count(records)
    assert (steps_, drafting) == (3, 2)
    assert nodes == {(0,): 1, (0, 1): 1, (2,): 1}


def synthetic(contexts: tuple, sizes: tuple, rows: list, repeats: int = 5, spread: float = 0.0) -> Calibration:
    """A calibration whose every point was timed ``repeats`` times around the given times (ms), +/- ``spread``."""
    offsets = [spread * (2 * r / (repeats - 1) - 1) for r in range(repeats)] if repeats > 1 else [0.0]
    samples = tuple(tuple(tuple(t * (1 + o) for o in offsets) for t in row) for row in rows)
    return Calibration(key={}, contexts=contexts, sizes=sizes, samples_ms=samples, drift={}, provenance={})


def test_calibration_interpolates_and_extrapolates_linearly():
    cal = synthetic((100, 300), (1, 3), [(10.0, 20.0), (30.0, 40.0)])
    assert cal.seconds(2, 200) == pytest.approx(0.025)
    assert cal.seconds(5, 100) == pytest.approx(0.030)  # past the largest q: the last slope goes on
    assert cal.seconds(1, 500) == pytest.approx(0.050)  # past the longest context likewise


def test_calibration_fits_step_times_that_never_fall_with_the_context():
    assert isotonic([45, 79, 96, 77, 80, 103]) == pytest.approx((45, 79, 84.333, 84.333, 84.333, 103), abs=1e-3)
    assert tuple(isotonic([1, 2, 3])) == (1, 2, 3)
    # a slow repeat at q=1 for context 300 would make q=2 look nearly free there; along q, cost stays as measured
    cal = synthetic((100, 300, 500), (1, 2, 3), [(10.0, 20.0, 18.0), (18.0, 19.0, 19.0), (12.0, 22.0, 21.0)])
    fitted = cal.curve.fitted.flatten().tolist()  # a line over the three contexts for every q
    assert fitted == pytest.approx([37 / 3, 58 / 3, 107 / 6, 40 / 3, 61 / 3, 116 / 6, 43 / 3, 64 / 3, 125 / 6])
    assert cal.seconds(2, 300) / cal.seconds(1, 300) == pytest.approx(61 / 40)  # not 19 / 18
    assert cal.seconds(3, 100) < cal.seconds(2, 100)  # a q that fills the kernels' blocks may cost less


def test_calibration_times_every_size_in_ascending_rounds_after_a_single_token(monkeypatch):
    """A small block right after a large one runs slower on some CPUs; a run's steps are of similar sizes, so a round
    times the sizes in ascending order after an untimed single-token step, never a size right after a larger one."""
    clock = [0.0]
    monkeypatch.setattr(calibrate, "time", type("Clock", (), {"perf_counter": staticmethod(lambda: clock[0])}))

    class Stub:  # a step of q tokens takes q ms, 5 ms more right after a larger block
        device, cache_kw, max_length, last = torch.device("cpu"), "past_key_values", None, 0

        def model(self, **kwargs): pass

        def sync(self): pass

        def new_cache(self, capacity): return type("Cache", (), {"commit": lambda self, n: None})()

        def generate(self, prompt, drafter, n): return type("Gen", (), {"output_ids": [0] * n})()

        def verify(self, root, position, draft, cache):
            q = 1 if draft is None else draft.shape.size
            clock[0] += (q + 5 * (self.last > q)) / 1000
            self.last = q

    samples, drift = calibrate.measure(Stub(), VOCAB, [1, 2, 8], [16], min_rounds=3, budget_s=0, target=0.02,
                                       decision_ratio=3, progress=False)
    assert samples == [[pytest.approx([1.0] * 3), pytest.approx([2.0] * 3), pytest.approx([8.0] * 3)]]
    assert drift["start"] == pytest.approx([1.0] * 5) and drift["end"] == pytest.approx([1.0] * 5)
    assert not drift["beyond_noise"]


def test_calibration_smooths_one_noisy_context_towards_its_neighbours():
    contexts = (128, 256, 512, 768, 1024, 1536, 2048)
    curve = np.array([50 + 0.01 * c + 4e-6 * c * c for c in contexts])  # a step's time: about linear, a little convex
    assert smoother(contexts) @ curve == pytest.approx(curve)
    noisy = curve.copy()
    noisy[2] *= 1.15  # one slow point
    assert abs((smoother(contexts) @ noisy)[2] / curve[2] - 1) < 0.08
    assert smoother((128,)) @ np.array([5.0]) == pytest.approx([5.0])
    assert smoother((1, 3)) @ np.array([2.0, 4.0]) == pytest.approx([2, 4])


def test_calibration_pads_a_block_to_a_larger_size_that_runs_faster():
    # as measured on this CPU: 3 and 7 tokens cost more than 4 and 8; 5 is within PAD_GAIN of 6; every point
    # measured 5 times within +/-1%: the gains are well beyond the noise
    cal = synthetic((100, 400), (1, 2, 3, 4, 5, 6, 7, 8), [(50.0, 80.0, 100.0, 70.0, 75.0, 73.0, 100.0, 80.0)] * 2,
                    spread=0.01)
    padding = cal.padding
    assert padding.bounds == (200,)
    assert [padding.size(q, 150) for q in range(1, 10)] == [1, 4, 4, 4, 5, 6, 8, 8, 9]
    assert cal.padded_seconds(7, 300) == pytest.approx(0.080) and cal.seconds(7, 300) == pytest.approx(0.100)
    assert cal.padded_seconds(1, 300) == pytest.approx(0.050)
    assert padding.describe()["buckets"][0] == {"below": 200, "pad": {"2": 4, "3": 4, "7": 8}}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict:
    """A tiny checkpoint, two disjoint question files, and the common overrides."""
    root = tmp_path_factory.mktemp("autotree")
    checkpoint = tiny_checkpoint(root / "ckpt", max_positions=256)
    words = "a b c d e f g h".split()

    def questions(name: str, offset: int) -> Path:
        path = root / f"{name}.jsonl"
        lines = [json.dumps({"question_id": i, "category": "qa",
                             "turns": [" ".join((words[(i + offset) % 8:] + words[:(i + offset) % 8]) * 3)]})
                 for i in range(4)]
        path.write_text("\n".join(lines) + "\n")
        return path

    common = ["model=hf", f"model.path={checkpoint}", "model.template=plain", "max_new_tokens=24", "dtype=float32",
              "device=cpu", "threads=1", f"autotree.dir={root / 'calibration'}", "run.progress=false", "warmup=0"]
    return {"root": root, "calib": questions("calib", 0), "eval": questions("eval", 4), "common": common}


def test_calibration_file_is_keyed_reused_and_refused_elsewhere(tiny):
    common = [*tiny["common"], *CAL]
    cfg = config(*common, name="calibrate")
    path = calibrate.calibrate(cfg)
    cal = Calibration.load(path)
    assert cal.key["threads"] == torch.get_num_threads() and cal.key["dtype"] == "float32"
    assert cal.contexts == (16, 64) and cal.sizes == (1, 2, 4, 8, 16)
    assert all(len(point) >= 2 and min(point) > 0 for row in cal.samples_ms for point in row)
    assert set(cal.drift) >= {"start", "middle", "end", "verdict"} and cal.key["format"] == store.CALIBRATION_FORMAT
    assert path.with_suffix(".png").is_file() and "repeats a point" in cal.summary()
    mtime = path.stat().st_mtime_ns
    assert calibrate.calibrate(cfg) == path and path.stat().st_mtime_ns == mtime  # same key: reused
    other = json.loads(path.read_text())
    other["key"]["device_name"] = "NVIDIA A100-SXM4-80GB"
    foreign = tiny["root"] / "a100.json"
    foreign.write_text(json.dumps(other))
    with pytest.raises(AutoTreeError, match=r"refusing calibration .*device_name \(.*A100"):
        run(config(*tiny["common"], f"data.path={tiny['eval']}", "method=recycling", "method.tree=auto",
                   f"autotree.calibration={foreign}", f"run.dir={tiny['root'] / 'never'}"))
    assert not (tiny["root"] / "never").exists()
    stale = json.loads(path.read_text())
    stale["key"]["masked_gqa"] = False  # under the same name, made with another attention path (an older file)
    path.write_text(json.dumps(stale))
    with pytest.raises(AutoTreeError, match=r"refusing calibration .*masked_gqa \(True vs False\)"):
        run(config(*tiny["common"], f"data.path={tiny['eval']}", "method=recycling", "method.tree=auto",
                   f"run.dir={tiny['root'] / 'never'}"))
    assert calibrate.calibrate(cfg) == path and Calibration.load(path).key == cal.key  # measured anew


def test_tree_auto_without_statistics_names_the_command(tiny):
    cal_cfg = CAL
    calibrate.calibrate(config(*tiny["common"], *cal_cfg, name="calibrate"))  # whichever test ran first here
    with pytest.raises(AutoTreeError, match="python -m evaluation.acceptance .*method=recycling"):
        run(config(*tiny["common"], f"data.path={tiny['eval']}", "method=recycling", "method.tree=auto",
                   f"run.dir={tiny['root'] / 'never'}"))


def test_padding_is_on_with_a_calibration_and_required_only_when_asked(tmp_path, tiny):
    with pytest.raises(AutoTreeError, match="autotree.pad=true: .*python -m evaluation.calibrate"):
        run(config(*tiny["common"], f"data.path={tiny['eval']}", "method=pld", "autotree.pad=true",
                   f"autotree.dir={tmp_path}", f"run.dir={tmp_path / 'never'}"))
    with pytest.raises(AutoTreeError, match="autotree.pad must be auto, true or false"):
        run(config(*tiny["common"], f"data.path={tiny['eval']}", "method=pld", "autotree.pad=sometimes",
                   f"run.dir={tmp_path / 'never'}"))
    path = run(config(*tiny["common"], f"data.path={tiny['eval']}", "method=pld", f"autotree.dir={tmp_path}",
                      f"run.dir={tmp_path / 'results'}"))
    meta = json.loads(path.with_name(path.name.replace(".jsonl", ".meta.json")).read_text())
    assert meta["padding"]["enabled"] is False and "evaluation.calibrate" in meta["padding"]["why"]


def test_without_a_calibration_tree_auto_names_the_command(tmp_path, tiny):
    with pytest.raises(AutoTreeError, match="python -m evaluation.calibrate model=hf"):
        run(config(*tiny["common"], f"data.path={tiny['eval']}", "method=pld", "method.num_pred_tokens=auto",
                   f"autotree.dir={tmp_path}", f"run.dir={tmp_path / 'never'}"))


@pytest.mark.parametrize("method, param, candidate", [
    (["method=recycling"], "tree", "wide"), (["method=pld"], "num_pred_tokens", 16),
    (["method=eagle", "method.head=random"], "tree", "wide"),  # a drafter with forwards of its own
], ids=["recycling", "pld", "eagle"])
def test_tree_auto_end_to_end_is_lossless_and_reports_its_prediction(tiny, method, param, candidate, capsys):
    cal_cfg = CAL
    calibrate.calibrate(config(*tiny["common"], *cal_cfg, name="calibrate"))
    stats_path = collect(config(*tiny["common"], f"data.path={tiny['calib']}", *method))
    stats = json.loads(stats_path.read_text())
    assert stats["candidate"] == {param: candidate}
    assert stats["steps"] > 0 and all(0 < n["p"] <= 1 for n in stats["nodes"])
    # collected again (make bench after a pull): reused, not rerun; another token budget or redo=true collects anew
    mtime = stats_path.stat().st_mtime_ns
    assert collect(config(*tiny["common"], f"data.path={tiny['calib']}", *method)) == stats_path
    assert stats_path.stat().st_mtime_ns == mtime and "acceptance: reusing" in capsys.readouterr().err
    for other in ("max_new_tokens=12", "autotree.redo=true"):
        again = config(*tiny["common"], f"data.path={tiny['calib']}", *method, other)
        assert store.reusable_statistics(again, False, {"candidate": stats["candidate"]}) is None
    # remade after its run's settings changed (a new calibration or commit; here the seed): started anew, not refused
    assert collect(config(*tiny["common"], f"data.path={tiny['calib']}", *method, "autotree.redo=true", "seed=1")) == stats_path
    assert "starting the statistics run anew" in capsys.readouterr().err

    # statistics collected on the evaluated questions are refused, unless allowed
    with pytest.raises(AutoTreeError, match="collected on 4 of the questions evaluated"):
        run(config(*tiny["common"], f"data.path={tiny['calib']}", *method, f"method.{param}=auto",
                   f"run.dir={tiny['root'] / 'never'}"))

    out = tiny["root"] / "results"
    drafting_cost = store.drafter_class(config(*method).method).drafting_cost
    if drafting_cost:  # its drafting time per tree shape is measured too, or tree=auto says how to measure it
        with pytest.raises(AutoTreeError, match=r"python -m evaluation\.calibrate model=hf .* method=eagle"):
            run(config(*tiny["common"], f"data.path={tiny['eval']}", *method, f"method.{param}=auto",
                       f"run.dir={tiny['root'] / 'never'}"))
        calibrate.calibrate(config(*tiny["common"], *cal_cfg, *method, "calibration.drafting_contexts=[16,64]",
                                   "calibration.drafting_steps=2", name="calibrate"))
    base = run(config(*tiny["common"], f"data.path={tiny['eval']}", "method=baseline", f"run.dir={out}"))
    auto = run(config(*tiny["common"], f"data.path={tiny['eval']}", *method, f"method.{param}=auto",
                      f"run.dir={out}"))
    ids = [[r["choices"][0]["output_ids"] for r in map(json.loads, p.read_text().splitlines())] for p in (base, auto)]
    assert ids[0] == ids[1]
    meta = json.loads(auto.with_name(auto.name.replace(".jsonl", ".meta.json")).read_text())
    planned = meta["drafter"]["plan"]
    assert planned["sources"]["acceptance"] == str(stats_path)
    assert ("drafting" in planned["sources"]) == drafting_cost
    assert all(("draft_ms" in b) == drafting_cost for b in planned["buckets"] if b["nodes"])
    assert meta["padding"]["enabled"] and planned["sources"]["padded"]  # a calibration exists: blocks are padded
    assert {"nodes", "expected_tokens", "predicted_tokens_per_s", "context"} <= set(planned["buckets"][0])

    assert speedup.main([str(auto.parent), "--out", str(tiny["root"] / "tables"), "--calibration",
                         str(tiny["root"] / "calibration")]) == 0
    text = capsys.readouterr().out
    assert "Cost model" in text and "Calibrated tok/s" in text
    comparisons, _ = analysis.pair_runs(analysis.load_runs([auto.parent]))
    cost = steps.cost_model(comparisons, tiny["root"] / "calibration")
    row = cost[cost["label"].str.contains("auto")].iloc[0]
    assert not math.isnan(row["calibrated_decode_tokens_per_s"]) and not math.isnan(row["predicted_mat"])
    assert 0 <= row["outside_forward"] < 1


def test_a_smaller_candidate_collects_statistics_of_its_own_nodes_only(tiny, tmp_path):
    stats_path = collect(config(*tiny["common"], f"data.path={tiny['calib']}", "method=eagle", "method.head=random",
                                "autotree.candidate=paper-b3", f"autotree.dir={tmp_path}"))
    stats = json.loads(stats_path.read_text())
    assert stats["candidate"] == {"tree": "paper-b3"} and stats["drafting_steps"] > 0
    result = Path(stats["provenance"]["result_file"])
    meta = json.loads(result.with_name(result.name.replace(".jsonl", ".meta.json")).read_text())
    assert meta["drafter"]["tree"] == "static, 7 nodes"  # the run verified the smaller candidate, not the wide one
    assert {tuple(n["path"]) for n in stats["nodes"]} <= set(map(tuple, load_template("paper-b3")))


def test_sam_falls_back_on_the_tree_chosen_from_token_recyclings_statistics(tiny):
    cal_cfg = CAL
    calibrate.calibrate(config(*tiny["common"], *cal_cfg, name="calibrate"))
    stats_path = collect(config(*tiny["common"], f"data.path={tiny['calib']}", "method=sam"))  # recycling's
    assert stats_path.name.startswith("acceptance-hf-float32-recycling-")
    with pytest.raises(AcceptanceError, match="its statistics are recycling's"):
        store.tunable(config("method=sam").method)
    out = tiny["root"] / "sam"
    paths = [run(config(*tiny["common"], f"data.path={tiny['eval']}", *method, f"run.dir={out}"))
             for method in (["method=baseline"], ["method=sam", "method.aux_tree=auto", "method.threshold=2"])]
    ids = [[r["choices"][0]["output_ids"] for r in map(json.loads, p.read_text().splitlines())] for p in paths]
    assert ids[0] == ids[1]
    meta = json.loads(paths[1].with_name(paths[1].name.replace(".jsonl", ".meta.json")).read_text())
    assert meta["drafter"]["aux"]["plan"]["sources"]["acceptance"] == str(stats_path)


def test_sam_mode_auto_chooses_by_match_length_from_its_own_statistics(tiny, tmp_path):
    cal_cfg = ["calibration.sizes=[1,2,4,8,16,24]", "calibration.contexts=[16,64]", "calibration.min_rounds=2",
               "calibration.budget_s=0"]
    calibrate.calibrate(config(*tiny["common"], *cal_cfg, f"autotree.dir={tmp_path}", name="calibrate"))
    method = ["method=sam", "method.mode=auto", "method.threshold=2", f"autotree.dir={tmp_path}"]
    with pytest.raises(AutoTreeError, match=r"method.mode=auto needs policy statistics .*python -m evaluation\.acceptance .*method=sam"):
        run(config(*tiny["common"], f"data.path={tiny['eval']}", *method, f"run.dir={tmp_path / 'never'}"))
    two = "autotree.passes=2"  # the second pass verifies the plan made from the first
    stats_path = acceptance.collect_policy(config(*tiny["common"], f"data.path={tiny['calib']}", *method, two))
    stats = store.PolicyStats.load(stats_path)
    assert stats_path.name.startswith("policy-hf-float32-sam-") and stats.score == 32
    assert "threshold" not in stats.key["method"] and "mode" not in stats.key["method"]  # what the policy replaces
    mtime = stats_path.stat().st_mtime_ns  # collected again with the same settings and scored chain: reused
    assert acceptance.collect_policy(config(*tiny["common"], f"data.path={tiny['calib']}", *method, two)) == stats_path
    assert stats_path.stat().st_mtime_ns == mtime
    # the second pass verified the plan made from the first, and scored every step
    result = Path(stats.provenance["result_file"])
    records = [json.loads(line) for line in result.read_text().splitlines()]
    assert stats.steps == sum(len(r["choices"][0]["accept_lengths"]) for r in records)
    assert json.loads(result.with_name(result.name.replace(".jsonl", ".meta.json")).read_text())["drafter"]["mode"] == "auto"
    with pytest.raises(AutoTreeError, match="collected on 4 of the questions evaluated"):
        run(config(*tiny["common"], f"data.path={tiny['calib']}", *method, f"run.dir={tmp_path / 'never'}"))

    out = tmp_path / "results"
    paths = [run(config(*tiny["common"], f"data.path={tiny['eval']}", *m, f"autotree.dir={tmp_path}", f"run.dir={out}"))
             for m in (["method=baseline"], method)]
    ids = [[r["choices"][0]["output_ids"] for r in map(json.loads, p.read_text().splitlines())] for p in paths]
    assert ids[0] == ids[1]
    meta = json.loads(paths[1].with_name(paths[1].name.replace(".jsonl", ".meta.json")).read_text())
    policy = meta["drafter"]["policy"]
    assert policy["sources"]["policy_statistics"] == str(stats_path)
    assert {"by_class", "expected_tokens", "predicted_tokens_per_s", "context"} <= set(policy["buckets"][0])
    comparisons, _ = analysis.pair_runs(analysis.load_runs([out]))
    cost = steps.cost_model(comparisons, tmp_path)
    row = cost[cost["label"].str.startswith("sam-auto")].iloc[0]
    assert not math.isnan(row["predicted_mat"]) and row["predicted_decode_tokens_per_s"] > 0


def test_acceptance_by_depth_and_rank_from_step_records(tmp_path):
    folder = tmp_path / "results" / "tiny" / "mini"
    folder.mkdir(parents=True)
    header = {"model": "tiny", "data": "mini", "dtype": "float32", "device": "cpu", "max_new_tokens": 8,
              "question_ids": [1]}
    choice = {"turns": ["x"], "new_tokens": [6], "wall_time": [1.0], "decoding_steps": [4], "output_ids": [[1] * 6],
              "prompt_tokens": [10], "prefill_time": [0.1], "decode_time": [0.9], "forward_time": [0.8]}
    runs = {"baseline": dict(choice, decoding_steps=[5], output_ids=[[1] * 6], accept_lengths=[1] * 5,
                             accept_paths=[[]] * 5, block_sizes=[1] * 5),
            "tree": dict(choice, accept_lengths=[3, 1, 2, 1], accept_paths=[[0, 0], [], [1], []],
                         block_sizes=[5, 5, 5, 1])}
    for label, c in runs.items():
        (folder / f"{label}.jsonl").write_text(json.dumps({"question_id": 1, "category": "qa", "choices": [c]}) + "\n")
        method = "baseline" if label == "baseline" else "recycling"
        (folder / f"{label}.meta.json").write_text(json.dumps({**header, "method": method, "label": label}))
    comparisons, _ = analysis.pair_runs(analysis.load_runs([folder]))
    table = steps.acceptance(comparisons)
    row = table[table["label"] == "tree"].iloc[0]
    assert row["steps"] == 4 and row["draft_rate"] == pytest.approx(0.75)
    assert (row["d1"], row["d2"], row["d3"]) == pytest.approx((2 / 3, 1 / 3, 0))
    assert (row["r0"], row["r1"], row["r2"]) == pytest.approx((1 / 3, 1 / 3, 0))
    assert list(table["label"]) == ["tree"]  # the baseline drafts nothing
    run_ = next(c.run for c in comparisons if c.run.label == "tree")
    assert [s[0] for s in run_.frame.loc[1, "steps"]] == [11, 14, 15, 17]  # contexts grow by the accepted tokens
    assert plots.main([str(folder), "--out", str(tmp_path / "plots")]) == 0
    assert (tmp_path / "plots" / "acceptance.png").is_file()


def test_the_shadow_tree_scores_exactly_what_verifying_it_would_accept(llama):
    """A wide tree scored in the shadow of a small one equals that wide tree's own acceptance when the matrix
    is the same: run with tree=paper and shadow=paper, every step's shadow verdict is the verified path."""
    prompt = [3, 4, 5, 3, 4, 5, 3, 4, 5, 3, 4]
    engine = Engine(llama, eos_token_ids=set())
    drafter = TokenRecycling(VOCAB, tree="paper-b4", shadow="paper-b4")
    engine.generate(prompt, drafter, 40)
    gen = engine.generate(prompt, drafter, 40)
    stats = gen.drafter_stats
    assert stats["shadow_steps"] == gen.decoding_steps
    verified: dict[str, int] = {}
    for path in gen.accept_paths:
        for d in range(1, len(path) + 1):
            name = ".".join(map(str, path[:d]))
            verified[name] = verified.get(name, 0) + 1
    assert stats["shadow_accepted"] == verified and verified


def test_statistics_count_the_shadow_tree_when_the_drafter_scored_one():
    stats = [{"shadow_steps": 3, "shadow_accepted": {"0": 2, "0.1": 1}}, {"shadow_steps": 1, "shadow_accepted": {}}]
    records = [{"choices": [{"accept_paths": [[0]] * 4, "block_sizes": [3] * 4, "drafter_stats": stats}]}]
    nodes, steps_, drafting = count(records)
    assert (steps_, drafting) == (4, 4) and nodes == {(0,): 2, (0, 1): 1}


def test_statistics_for_tree_auto_are_collected_as_for_the_default_tree(tiny, tmp_path):
    """`make calibrate` passes an entry's settings as written: recycling:tree=auto, with no statistics yet. The first
    pass verifies the drafter's statistics tree (Token Recycling's 7-node paper-b3: a pass costs about a greedy run),
    a second pass, where asked for, the plan made from the first."""
    cal_cfg = CAL
    own = [*tiny["common"], f"autotree.dir={tmp_path}"]
    calibrate.calibrate(config(*own, *cal_cfg, name="calibrate"))
    method = ["method=recycling", "method.tree=auto", f"data.path={tiny['calib']}"]
    stats = json.loads(collect(config(*own, *method)).read_text())
    assert stats["key"]["method"] == store.method_key(config("method=recycling").method)
    assert list((tmp_path / "runs").rglob("recycling-paper-b3-k8-hot-*.jsonl"))  # one pass, on the statistics tree
    assert stats["scored"] == "in the shadow of method.tree=paper-b3"
    stats = json.loads(collect(config(*own, *method, "autotree.passes=2", "autotree.redo=true")).read_text())
    assert stats["scored"] == "in the shadow of method.tree=auto"  # the second, the plan made from the first


def test_make_calibrate_collects_with_each_auto_entrys_settings():
    """`make bench METHODS=sam:aux=none,mode=auto` must collect SAM alone's statistics, not the default's, and
    `sam:mode=auto,aux_tree=auto` those scored with the fallback tree chosen for the machine."""
    import shutil
    import subprocess

    if not shutil.which("make"):
        pytest.skip("make is not installed")
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run(["make", "-s", "-C", str(root), "-o", ".venv/.installed", "-o", "data", "calibrate",
                          "PY=echo", "DATA=spec_bench_mini",
                          "METHODS=baseline sam:aux=none,mode=auto recycling:tree=auto,k=4 sam:mode=auto,aux_tree=auto"],
                         capture_output=True, text=True, check=True).stdout.splitlines()
    acceptance_runs = sorted(line.split() for line in out if "evaluation.acceptance" in line)
    assert [run[2:6] for run in acceptance_runs] == [
        ["model=smollm2-135m", "method=recycling", "method.tree=auto", "method.k=4"],
        ["model=smollm2-135m", "method=sam", "method.aux=none", "method.mode=auto"],
        ["model=smollm2-135m", "method=sam", "method.mode=auto", "method.aux_tree=auto"]]
    assert not any("=auto" in line for line in out if "evaluation.calibrate" in line)
    # on questions of the evaluated categories that are not evaluated
    assert all("data=spec_bench_mini" in run and "autotree.heldout=2" in run for run in acceptance_runs)


def test_the_calibration_says_when_the_machine_moved_or_was_busy():
    steady = calibrate._verdict({"context": 512, "start": [10.0, 10.1, 9.9, 10.0, 10.0],
                                 "end": [10.1, 10.0, 10.1, 10.2, 10.1]})
    assert not steady["beyond_noise"] and "held" in steady["verdict"]
    moved = calibrate._verdict({"context": 512, "start": [10.0] * 5, "end": [11.5, 11.5, 11.6, 11.4, 11.5]})
    assert moved["beyond_noise"] and "moved by +15.0%" in moved["verdict"]
    busy = calibrate._verdict({"context": 512, "start": [10.0, 14.0, 7.0, 12.0, 10.0], "end": [17.0] * 5})
    assert busy["beyond_noise"] and "the machine was busy" in busy["verdict"]


def test_statistics_collected_for_the_evaluated_set_come_before_another_sets_with_more_steps(tmp_path):
    cfg = config("model=smollm2-135m", "data=humaneval", "method=recycling", "method.tree=auto",
                 f"autotree.dir={tmp_path}")
    key = store.statistics_key(cfg, cfg.method, "float32")

    def write(data: str, steps: int) -> Path:
        [path] = store.statistics_paths(tmp_path, cfg.model.name, "float32", cfg.method, data=data)
        path.write_text(json.dumps({"key": key, "nodes": [{"path": [0], "p": 0.5}], "draft_rate": 1.0,
                                    "steps": steps, "question_hashes": [], "provenance": {}}))
        return path

    write("spec_bench-heldout2", 5000)
    own = write("humaneval-heldout8", 500)
    most = write("humaneval_extra-heldout2", 9000)  # a name that only starts with the evaluated set's
    _, path = store.find_statistics(cfg, cfg.method, "float32", questions=[])
    assert path == own
    own.unlink()
    _, path = store.find_statistics(cfg, cfg.method, "float32", questions=[])
    assert path == most  # no statistics of the evaluated set: the most steps, whichever set


def test_statistics_of_the_evaluated_set_that_overlap_it_are_passed_over_loudly(tmp_path, capsys):
    """The first 12 HumanEval problems' statistics (held out: problems 12-19) cannot serve the first 40: another
    set's are taken, and the output says so with the command that makes the evaluated set's own."""
    cfg = config("model=smollm2-135m", "data=humaneval", "method=recycling", "method.tree=auto",
                 f"autotree.dir={tmp_path}")
    key = store.statistics_key(cfg, cfg.method, "float32")
    question = {"question_id": 12, "category": "humaneval", "turns": ["def f():"]}
    for data, hashes in (("spec_bench-heldout2", []), ("humaneval-heldout8", store.question_hashes([question]))):
        [path] = store.statistics_paths(tmp_path, cfg.model.name, "float32", cfg.method, data=data)
        path.write_text(json.dumps({"key": key, "nodes": [{"path": [0], "p": 0.5}], "draft_rate": 1.0,
                                    "steps": 500, "question_hashes": hashes, "provenance": {}}))
    _, path = store.find_statistics(cfg, cfg.method, "float32", questions=[question])
    assert "spec_bench-heldout2" in path.name
    err = capsys.readouterr().err
    assert "takes its statistics from another question set" in err and "humaneval-heldout8" in err
    assert "was collected on 1 of the questions evaluated here" in err and "python -m evaluation.acceptance" in err
