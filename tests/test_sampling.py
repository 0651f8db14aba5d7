"""Sampling (methods.sampling, docs/sampling.md): the sampler draws exactly from the tempered, truncated
distribution, its noise is keyed by position, and every method's output equals the baseline's for the same seed,
token by token, as under greedy decoding; the harness keeps sampled runs, baselines and statistics apart."""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
from pathlib import Path

import pytest
import torch
from filelock import FileLock
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import VOCAB
from evaluation import acceptance, analysis, calibrate, equal
from evaluation.api import generate
from evaluation.host_syncs import HostSyncs
from evaluation.run import generation_key, run
from evaluation.store import AutoTreeError
from helpers import config, tiny_checkpoint
from methods.drafter import Drafter
from methods.eagle import Eagle
from methods.engine import Engine
from methods.lookahead import Lookahead
from methods.pld import PromptLookup
from methods.recycling import TokenRecycling
from methods.sam import SamDecoding
from methods.sampling import Sampling
from test_engine import MODELS, RandomTrees, greedy, prompts

# ------------------------------------------------------------------------------------------------- the sampler

Z = 3.719  # the standard normal's upper 1e-4 quantile: the tests' fixed threshold


def chi2_limit(df: int) -> float:
    """The chi-square distribution's upper 1e-4 quantile (Wilson and Hilferty's approximation)."""
    return df * (1 - 2 / (9 * df) + Z * math.sqrt(2 / (9 * df))) ** 3


def expected(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """The tempered, truncated softmax, written plainly (float64): top-k keeps the tokens at or above the k-th
    logit, top-p those whose more probable tokens hold less than top_p of what top-k kept."""
    keep = torch.ones(len(logits), dtype=torch.bool)
    if top_k:
        keep &= logits >= logits.topk(top_k).values[-1]
    p = torch.where(keep, logits.double() / temperature, -math.inf).softmax(-1)
    if top_p < 1:
        keep &= torch.tensor([p[logits > logits[v]].sum() < top_p for v in range(len(p))])
        p = torch.where(keep, p, 0)
        p = p / p.sum()
    return p


def draws(rule: Sampling, logits: torch.Tensor, n: int = 40000, keys: int = 8) -> torch.Tensor:
    """Counts of every token over ``n`` draws: ``keys`` generation keys x as many positions each."""
    per = n // keys
    counts = torch.zeros(len(logits), dtype=torch.long)
    for key in range(keys):
        rows = logits.expand(per, -1)
        counts += torch.bincount(rule.choose(rows, key, 1000, torch.arange(per), per), minlength=len(logits))
    return counts


def chi2(counts: torch.Tensor, p: torch.Tensor) -> tuple[float, int]:
    support = p > 0
    e = counts.sum() * p[support]
    return float(((counts[support] - e) ** 2 / e).sum()), int(support.sum()) - 1


TIES = torch.tensor([2.0, 1.0, 1.0, 0.0, -1.0, -3.0])
CASES = [  # logits, temperature, top_k, top_p
    (TIES, 1.0, 0, 1.0), (TIES, 0.7, 0, 1.0), (TIES, 1.5, 0, 1.0),
    (TIES, 1.3, 2, 1.0),  # the k-th logit is tied: both kept
    (TIES, 1.0, 0, 0.8), (TIES, 0.7, 4, 0.9), (TIES, 2.0, 0, 0.95),
    (torch.tensor([3.0, -2.0, 0.5, 0.5, 1.0, -0.5, 2.5, 0.0]), 0.8, 5, 0.7),
    (torch.zeros(8), 1.0, 0, 1.0), (torch.zeros(8), 1.0, 0, 0.5),  # flat: no token is more probable, all kept
    (torch.tensor([-math.inf, -math.inf, 5.0, -math.inf]), 1.0, 0, 1.0),  # one-hot
    (torch.tensor([0.0, 9.0, 0.0, -1.0]), 1.0, 0, 0.9),  # one token holds 0.9997: the nucleus is one-hot
]


@pytest.mark.parametrize("logits, temperature, top_k, top_p", CASES)
def test_the_sampler_draws_the_tempered_truncated_softmax(logits, temperature, top_k, top_p):
    rule = Sampling(temperature, top_k, top_p)
    counts = draws(rule, logits)
    p = expected(logits, temperature, top_k, top_p)
    assert counts[p == 0].sum() == 0, "a token outside top-k / top-p was drawn"
    stat, df = chi2(counts, p)
    if df == 0:
        return
    assert stat < chi2_limit(df), (counts, p)
    # the test can tell: a temperature 10% off, or ignored, fails it wherever it changes the distribution
    for wrong in (1.1 * temperature, 1.0):
        q = expected(logits, wrong, top_k, top_p)
        if (q > 0).equal(p > 0) and (q - p).abs().max() > 0.02:
            assert chi2(counts, q)[0] > chi2_limit(df)


@settings(max_examples=30)
@given(seed=st.integers(0, 2**16), temperature=st.sampled_from([0.3, 0.7, 1.0, 1.6]),
       top_k=st.sampled_from([0, 1, 3, 40]), top_p=st.sampled_from([0.1, 0.5, 0.9, 0.99]))
def test_both_ways_to_the_nucleus_choose_alike(seed, temperature, top_k, top_p):
    """A CPU finds top-p's nucleus by a check per row, a GPU by sorting every row: the same tokens."""
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(64, 50, generator=gen) * 3).round(decimals=1)  # ties
    rule = Sampling(temperature, top_k, top_p, seed=seed)
    noise = rule.noise(seed, 10, 64, 50, "cpu").mul_(temperature)
    kth = logits.topk(top_k, -1).values[:, -1:] if top_k else None
    scores = noise + logits if kth is None else (noise + logits).masked_fill(logits < kth, -math.inf)
    assert torch.equal(rule._nucleus_by_check(logits, scores.clone(), kth), rule._nucleus_by_sort(logits, scores, kth))


def test_the_noise_is_keyed_by_position_not_by_block():
    rule = Sampling(1.0, seed=3)
    block = rule.noise(7, 100, 6, 64, "cpu")
    assert block.isfinite().all() and block.shape == (6, 64)
    for i in range(6):
        assert torch.equal(block[i], rule.noise(7, 100 + i, 1, 64, "cpu")[0])
    columns = torch.tensor([5, 0, 63])
    assert torch.equal(rule.noise(7, 100, 6, 64, "cpu", columns), block[:, columns])
    for other in (rule.noise(8, 100, 6, 64, "cpu"), Sampling(1.0, seed=4).noise(7, 100, 6, 64, "cpu")):
        assert (other != block).float().mean() > 0.99  # another key or seed: other noise
    logits = torch.randn(6, 64)
    offsets = torch.tensor([0, 2, 2, 5, 1, 0])
    together = rule.choose(logits, 7, 100, offsets, 6)
    assert together.tolist() == [int(rule.choose(logits[i : i + 1], 7, 100 + int(o))) for i, o in enumerate(offsets)]


def test_greedy_is_the_argmax_whatever_the_other_settings():
    logits = torch.randn(9, 64)
    assert torch.equal(Sampling(0, top_k=3, top_p=0.5, seed=9).choose(logits, 1, 0), logits.argmax(-1))
    assert Sampling().tag() == "" and Sampling(0.7, 0, 0.9, 2).tag() == "T0.7-p0.9-s2"
    assert Sampling(1, top_k=50).tag() == "T1-k50"


@pytest.mark.parametrize("settings_, message", [
    ({"temperature": -1}, "sampling.temperature must be a number >= 0"), ({"top_k": -2}, "sampling.top_k"),
    ({"top_p": 0}, r"sampling.top_p must be in \(0, 1\]"), ({"top_p": 1.5}, "sampling.top_p")])
def test_bad_settings_say_which_key(settings_, message):
    with pytest.raises(ValueError, match=message):
        Sampling(**settings_)


# ------------------------------------------------------------------------------------------------- the engine

RULES = {"T1": Sampling(1.0, seed=5), "T0.7-p0.9": Sampling(0.7, top_p=0.9, seed=5)}


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("rule", RULES.values(), ids=RULES)
@settings(max_examples=6)
@given(prompt=prompts, seed=st.integers(0, 2**16), key=st.integers(0, 2**64 - 1), extras=st.booleans())
def test_random_trees_are_lossless_under_sampling(name, rule, prompt, seed, key, extras):
    """Deep, branching, non-contiguous accepted paths (nodes drawn from the sampled baseline's own output)."""
    engine = Engine(MODELS[name], set(), sampling=rule)
    reference = engine.generate(prompt, Drafter(VOCAB), 24, key=key).output_ids
    gen = engine.generate(prompt, RandomTrees(reference, len(prompt), seed, hit=0.8, extras=extras), 24, key=key)
    assert gen.output_ids == reference
    assert sum(gen.accept_lengths) == 23


def drafters() -> dict:
    """Every method's drafter on the tiny models (EAGLE: an untrained head, its static and dynamic trees, both
    drafting options)."""
    eagle = {"head": "random", "total_tokens": 8, "depth": 3, "top_k": 2}
    return {
        "recycling": lambda: TokenRecycling(VOCAB, tree="paper"),
        "recycling-cold": lambda: TokenRecycling(VOCAB, tree="paper-b3", start="cold"),
        "pld": lambda: PromptLookup(VOCAB),
        "lookahead": lambda: Lookahead(VOCAB),
        "sam": lambda: SamDecoding(VOCAB, threshold=2),
        "sam-switch": lambda: SamDecoding(VOCAB, threshold=2, mode="switch"),
        **{f"eagle-{tree}-{draft}": (lambda tree=tree, draft=draft: Eagle(VOCAB, tree=tree, draft=draft, **eagle))
           for tree in ("paper-b3", "dynamic") for draft in ("topk", "coupled")},
    }


@pytest.mark.parametrize("method", drafters())
@pytest.mark.parametrize("rule", RULES.values(), ids=RULES)
def test_every_method_equals_the_sampled_baseline(llama, method, rule):
    engine = Engine(llama, set(), sampling=rule)
    drafter = drafters()[method]()
    prompt = [3, 1, 4, 1, 5, 9, 2, 6] * 3  # repeats for the copying drafters
    accepted = 0
    for key in range(3):  # the drafter's hot-start state carries over, as in a run
        want = engine.generate(prompt, Drafter(VOCAB), 32, key=key).output_ids
        gen = engine.generate(prompt, drafter, 32, key=key)
        assert gen.output_ids == want
        accepted += sum(gen.accept_lengths) - len(gen.accept_lengths)
    if method == "recycling":
        assert accepted > 0, "no draft was ever accepted: the drafts are not being exercised"


@pytest.mark.parametrize("name", MODELS)
def test_another_seed_samples_another_answer_and_temperature_zero_is_greedy(name):
    model, prompt = MODELS[name], [5, 9, 2, 33, 7]
    answers = {seed: Engine(model, set(), sampling=Sampling(1.0, seed=seed)).generate(prompt, Drafter(VOCAB), 20,
                                                                                       key=1).output_ids
               for seed in (0, 1)}
    assert answers[0] != answers[1]
    assert Engine(model, set(), sampling=Sampling(1.0, seed=0)).generate(prompt, Drafter(VOCAB), 20,
                                                                          key=2).output_ids != answers[0]
    zero = Engine(model, set(), sampling=Sampling(0, top_p=0.5, seed=3)).generate(prompt, Drafter(VOCAB), 20, key=4)
    assert zero.output_ids == greedy(model, prompt, 20) == Engine(model, set()).generate(prompt, Drafter(VOCAB),
                                                                                         20).output_ids


@pytest.mark.parametrize("make", [lambda: Drafter(VOCAB), lambda: TokenRecycling(VOCAB, tree="paper")],
                         ids=["baseline", "recycling"])
def test_sampling_adds_no_host_read(llama, make):
    """The noise and top-k stay on the device: a sampled step reads the host as often as a greedy one (top-p on a
    CPU reads which rows to rank, docs/sampling.md)."""
    prompt, counts = [3, 1, 4, 1, 5, 9, 2, 6], []
    for rule in (Sampling(), Sampling(1.0), Sampling(0.8, top_k=5)):
        engine, drafter = Engine(llama, set(), sampling=rule), make()
        engine.generate(prompt, drafter, 16, key=1)
        with HostSyncs() as syncs:
            gen = engine.generate(prompt, drafter, 16, key=2)
        counts.append(syncs.total - len(gen.accept_lengths))  # one read per step, besides the prefill's
    assert counts[0] == counts[1] == counts[2]


def test_coupled_eagle_drafts_the_heads_own_sample_first(llama):
    """draft=coupled under sampling: the first child of every node is the head's draw with the target's noise at
    the position it predicts; greedy decoding drafts as topk."""
    prompt, key = [3, 1, 4, 1, 5, 9, 2, 6], 11
    seen = {}

    class Spy(Eagle):
        def _ranked(self, logp, width, depth):
            ranked = super()._ranked(logp, width, depth)
            seen.setdefault("first", (logp, ranked, depth, self._noise))
            return ranked

    for rule in (Sampling(0.8, top_k=20, seed=2), Sampling()):
        seen.clear()
        engine = Engine(llama, set(), sampling=rule)
        engine.generate(prompt, Spy(VOCAB, head="random", tree="paper-b3", draft="coupled"), 3, key=key)
        logp, ranked, depth, noise = seen["first"]
        if rule.greedy:
            assert noise is None and torch.equal(ranked, logp.topk(ranked.shape[-1], -1).indices)
            continue
        position = len(prompt) + 1 + depth  # the first draft: after the prefill's token
        want = rule.noise(key, position, 1, VOCAB, "cpu").mul_(rule.temperature)
        assert torch.equal(noise[depth], want[0])
        assert torch.equal(ranked[:, 0], rule.select(logp, logp + want))


# ------------------------------------------------------------------------------------------------- the harness

WORDS = "a b c d e f g h".split()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict:
    """A tiny checkpoint, two disjoint question files, and the common overrides of a sampled run."""
    root = tmp_path_factory.mktemp("sampling")
    checkpoint = tiny_checkpoint(root / "ckpt", max_positions=256)

    def questions(name: str, offset: int, n: int = 4) -> Path:
        path = root / f"{name}.jsonl"
        path.write_text("".join(json.dumps({"question_id": i, "category": "qa", "turns": [
            " ".join((WORDS[(i + offset) % 8:] + WORDS[:(i + offset) % 8]) * 3), "a b c"]}) + "\n" for i in range(n)))
        return path

    common = ["model=hf", f"model.path={checkpoint}", "model.template=plain", "max_new_tokens=24", "dtype=float32",
              "device=cpu", "threads=1", f"autotree.dir={root / 'calibration'}", "run.progress=false", "warmup=0"]
    return {"root": root, "calib": questions("calib", 0), "eval": questions("eval", 4), "common": common}


def output_ids(path: Path) -> dict:
    return {r["question_id"]: r["choices"][0]["output_ids"] for r in map(json.loads, path.read_text().splitlines())}


def test_a_sampled_run_names_its_settings_and_pairs_only_with_its_own_baseline(tiny, capsys):
    out = tiny["root"] / "named"
    sampled = ["sampling.temperature=0.7", "sampling.top_p=0.9"]
    greedy_run, base, method = (run(config(*tiny["common"], f"data.path={tiny['eval']}", *m, f"run.dir={out}"))
                                for m in (["method=baseline"], ["method=baseline", *sampled],
                                          ["method=recycling", *sampled]))
    assert greedy_run.name == "baseline-float32-cpu-run0.jsonl"  # greedy: named as ever
    assert base.name == "baseline-T0.7-p0.9-float32-cpu-run0.jsonl"
    assert method.name == "recycling-paper-k8-hot-T0.7-p0.9-float32-cpu-run0.jsonl"
    meta = json.loads(base.with_name(base.name.replace(".jsonl", ".meta.json")).read_text())
    assert meta["config"]["sampling"] == {"temperature": 0.7, "top_k": 0, "top_p": 0.9, "seed": 0}
    assert meta["label"] == "baseline-T0.7-p0.9"
    records = [json.loads(line) for line in base.read_text().splitlines()]
    assert {r["model_id"] for r in records} == {"hf-temp-0.7"}  # as Spec-Bench's answer files
    assert json.loads(greedy_run.read_text().splitlines()[0])["model_id"] == "hf-temp-0.0"
    assert output_ids(method) == output_ids(base) != output_ids(greedy_run)

    comparisons, _ = analysis.pair_runs(analysis.load_runs([out]))
    pairs = {c.run.label: c.reference.label for c in comparisons}
    assert pairs["recycling-paper-k8-hot-T0.7-p0.9"] == "baseline-T0.7-p0.9"
    assert equal.main([str(out), "--strict"]) == 0
    capsys.readouterr()
    differ = r"config\.sampling\.temperature \(0\.7 vs 0\.0\); config\.sampling\.top_p \(0\.9 vs 1\.0\)"
    with pytest.raises(analysis.ProvenanceError, match=differ):
        analysis.pair_runs(analysis.load_runs([method]), analysis.load_runs([greedy_run]))
    other_seed = run(config(*tiny["common"], f"data.path={tiny['eval']}", "method=baseline", *sampled,
                            "sampling.seed=1", f"run.dir={tiny['root'] / 'seed'}"))
    assert other_seed.name == "baseline-T0.7-p0.9-s1-float32-cpu-run0.jsonl"
    assert output_ids(other_seed) != output_ids(base)
    with pytest.raises(analysis.ProvenanceError, match=r"config\.sampling\.seed \(0 vs 1\)"):
        analysis.pair_runs(analysis.load_runs([method]), analysis.load_runs([other_seed]))


def test_a_header_without_sampling_settings_decoded_greedily():
    old = {"model": "m", "config": {}}
    assert analysis.provenance_diff(old, {"model": "m", "config": {"sampling": {"temperature": 0, "top_p": 0.5}}}) == []
    assert analysis.provenance_diff(old, {"model": "m", "config": {"sampling": {"temperature": 1.0}}}) == [
        "config.sampling.temperature (0.0 vs 1.0)"]
    assert not [k for k in analysis.unknown_provenance(old, old) if "sampling" in k]  # known: greedy


def test_a_resumed_sampled_run_continues_as_an_uninterrupted_one(tiny):
    """The noise is keyed by question, turn and position, not drawn from a stream: a run cut after two questions
    and resumed answers the rest as the uninterrupted run did."""
    args = [*tiny["common"], f"data.path={tiny['eval']}", "method=recycling", "sampling.temperature=1"]
    whole = run(config(*args, f"run.dir={tiny['root'] / 'whole'}"))
    cut = tiny["root"] / "cut" / whole.relative_to(tiny["root"] / "whole")
    shutil.copytree(whole.parent, cut.parent)
    lines = cut.read_text().splitlines(keepends=True)
    cut.write_text("".join(lines[:2]))
    resumed = run(config(*args, f"run.dir={tiny['root'] / 'cut'}"))
    assert resumed == cut and output_ids(resumed) == output_ids(whole)
    assert generation_key(1, 0) == generation_key(1, 0) != generation_key(1, 1)


def test_statistics_are_keyed_by_the_sampling_settings(tiny, capsys):
    """tree=auto (recycling) and mode=auto (sam) at T > 0: greedy statistics are refused with the command that
    collects them at this temperature; collected so, the chosen tree and policy are lossless."""
    cal_cfg = ["calibration.sizes=[1,2,4,8,16,24]", "calibration.contexts=[16,64]", "calibration.min_rounds=2", "calibration.budget_s=0"]
    calibrate.calibrate(config(*tiny["common"], *cal_cfg, name="calibrate"))
    greedy_stats = acceptance.collect(config(*tiny["common"], f"data.path={tiny['calib']}", "method=recycling",
                                             "autotree.passes=1"))
    sampled = ["sampling.temperature=1", "sampling.top_k=20"]
    auto = [["method=recycling", "method.tree=auto"], ["method=sam", "method.mode=auto", "method.threshold=2"]]
    with pytest.raises(AutoTreeError, match=r"differs in sampling \(\{'temperature': 1.0, 'top_k': 20, 'top_p': 1.0\} "
                                            r"vs None\).*python -m evaluation\.acceptance .*method=recycling "
                                            r"sampling\.temperature=1\.0 sampling\.top_k=20 sampling\.top_p=1\.0"):
        run(config(*tiny["common"], f"data.path={tiny['eval']}", *auto[0], *sampled, f"run.dir={tiny['root'] / 'no'}"))
    stats = acceptance.collect(config(*tiny["common"], f"data.path={tiny['calib']}", "method=recycling", *sampled,
                                      "autotree.passes=1"))
    assert stats.name == greedy_stats.name.replace("-spec_bench_mini.json", "-T1-k20-p1-spec_bench_mini.json")
    assert json.loads(stats.read_text())["key"]["sampling"] == {"temperature": 1.0, "top_k": 20, "top_p": 1.0}
    assert "sampling" not in json.loads(greedy_stats.read_text())["key"]  # greedy statistics: keyed as ever
    acceptance.collect_policy(config(*tiny["common"], f"data.path={tiny['calib']}", *auto[1], *sampled,
                                     "autotree.passes=1"))
    out = tiny["root"] / "auto"
    paths = [run(config(*tiny["common"], f"data.path={tiny['eval']}", *m, *sampled, f"run.dir={out}"))
             for m in (["method=baseline"], *auto)]
    assert output_ids(paths[0]) == output_ids(paths[1]) == output_ids(paths[2])
    for path in paths[1:]:
        steps = [a for r in map(json.loads, path.read_text().splitlines()) for a in r["choices"][0]["accept_lengths"]]
        assert sum(steps) > len(steps), f"{path.name}: nothing drafted was accepted; the plan is not exercised"


def test_the_python_api_samples_by_keyword(tiny):
    from evaluation.models import load
    loaded = load(config(*tiny["common"]).model, torch.device("cpu"), torch.float32)
    outs = [generate(loaded.model, loaded.tokenizer, "a b c d", method=m, max_new_tokens=12, model_name="hf",
                     temperature=0.9, top_p=0.95, seed=seed) for m, seed in (("baseline", 1), ("pld", 1), ("pld", 2))]
    assert outs[0].ids == outs[1].ids != outs[2].ids


# ------------------------------------------------------------------------------------------------- SmolLM2, end to end

E2E = ["data=spec_bench_mini", "data.categories=[translation,qa]", "data.per_category=1", "max_new_tokens=12",
       "warmup=0", "dtype=float32", "device=cpu", "run.progress=false"]
E2E_RULES = {"T1": ["sampling.temperature=1"], "T0.7-p0.9": ["sampling.temperature=0.7", "sampling.top_p=0.9"],
             "T0": []}  # greedy: the =auto methods with their plans correcting themselves (issue 31); the rest: test_e2e
EAGLE_DYNAMIC = ["method=eagle", "method.tree=dynamic", "method.total_tokens=8", "method.depth=3", "method.top_k=2"]
E2E_METHODS = {
    "recycling": ["method=recycling"], "recycling-auto": ["method=recycling", "method.tree=auto"],
    "pld": ["method=pld"], "lookahead": ["method=lookahead"],
    "sam": ["method=sam"], "sam-switch": ["method=sam", "method.mode=switch"],
    "sam-auto": ["method=sam", "method.mode=auto"], "pld-auto": ["method=pld", "method.num_pred_tokens=auto"],
    "eagle": ["method=eagle"], "eagle-coupled": ["method=eagle", "method.draft=coupled"],  # the CPU default: static
    "eagle-dynamic": EAGLE_DYNAMIC, "eagle-dynamic-coupled": [*EAGLE_DYNAMIC, "method.draft=coupled"],
}


@pytest.fixture(scope="session")
def shared_dir(tmp_path_factory) -> Path:
    """A folder all xdist workers of this session share (as tests/test_e2e.py's)."""
    root = tmp_path_factory.getbasetemp()
    return (root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root) / "e2e-sampling"


def shared(shared_dir: Path, *overrides: str) -> Path:
    """A SmolLM2 run made once per session (test_e2e's pattern: the first xdist worker to ask makes it under a lock);
    ``=auto`` methods read a calibration and statistics made here the same way, at the run's temperature."""
    shared_dir.mkdir(parents=True, exist_ok=True)
    key = hashlib.sha1(" ".join(overrides).encode()).hexdigest()[:16]
    with FileLock(shared_dir / f"{key}.lock"):
        done = shared_dir / f"{key}.path"
        if not done.exists():
            auto = [f"autotree.dir={shared_dir / 'calibration'}"] if any("=auto" in o for o in overrides) else []
            if auto:
                statistics(shared_dir, auto, [o for o in overrides if o.startswith("sampling.")])
            done.write_text(str(run(config(*E2E, *overrides, *auto, f"run.dir={shared_dir / 'results'}"))))
    return Path(done.read_text())


def statistics(shared_dir: Path, auto: list[str], sampled: list[str]) -> None:
    """A quick calibration, and Token Recycling's and SAM's statistics on another question at this temperature."""
    with FileLock(shared_dir / "statistics.lock"):
        calibrate.calibrate(config(*E2E, *auto, "calibration.sizes=[1,2,4,8,16]", "calibration.contexts=[64,256]",
                                   "calibration.min_rounds=2", "calibration.budget_s=0", name="calibrate"))
        other = [*E2E, *auto, *sampled, "data.categories=[math_reasoning]", "autotree.passes=1"]
        acceptance.collect(config(*other, "method=recycling", "method.tree=paper-b3", "autotree.candidate=paper-b3"))
        acceptance.collect_policy(config(*other, "method=sam", "method.mode=auto"))
        acceptance.collect(config(*other, "method=pld", "autotree.candidate=8"))


E2E_CASES = [(rule, method) for rule in E2E_RULES for method in E2E_METHODS  # at top-p, the tiny models above
             if (rule == "T1" or not method.endswith(("coupled", "switch")))  # test these variants (time)
             and (rule != "T0" or method.endswith("auto"))]


@pytest.mark.slow
@pytest.mark.parametrize("rule, method", E2E_CASES, ids=[f"{r}-{m}" for r, m in E2E_CASES])
def test_every_method_equals_the_sampled_baseline_on_smollm2(shared_dir, rule, method):
    path = shared(shared_dir, *E2E_RULES[rule], *E2E_METHODS[method])  # before the baseline: another worker may make it
    baseline = shared(shared_dir, *E2E_RULES[rule], "method=baseline")
    assert output_ids(path) == output_ids(baseline)
    assert equal.main([str(baseline), str(path), "--strict"]) == 0
