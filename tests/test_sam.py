"""SAM-Decoding: the automaton against brute force, the drafts, the fallback, losslessness on the tiny models."""

import itertools
import json
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import DEVICE, VOCAB
from evaluation import analysis, speedup, steps
from evaluation.categories import group_of
from evaluation.build import build_drafter
from helpers import config
from methods.drafter import Drafter
from methods.engine import Engine
from methods.recycling import TokenRecycling
from methods.sam import Context, Match, SamDecoding, SuffixAutomaton
from methods.tree import interned
from methods.tree_search import MAX_CLASS, PolicyChoice, PolicyPlan, StepOption, best_policy

TREE = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]


def longest_earlier(ids: list[int]) -> int:
    """The definition, by brute force: the longest suffix of ``ids`` that also ends before its last position."""
    n = len(ids)
    for length in range(n - 1, 0, -1):
        if any(ids[end - length + 1 : end + 1] == ids[n - length :] for end in range(length - 1, n - 1)):
            return length
    return 0


def longest_in(stream: list[int], text: list[int]) -> int:
    """The longest suffix of ``stream`` that occurs in ``text``, by brute force."""
    for length in range(len(stream), 0, -1):
        suffix = stream[len(stream) - length :]
        if any(text[i : i + length] == suffix for i in range(len(text) - length + 1)):
            return length
    return 0


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 3), max_size=16), st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=6), max_size=8))
def test_context_match_equals_brute_force_as_the_context_grows(prompt, chunks):
    """After every appended token: the longest earlier match, and its recorded end is a real occurrence."""
    context = Context()
    ids: list[int] = []
    for token in prompt + [t for chunk in chunks for t in chunk]:
        ids.append(token)
        context.append(token)
        match = context.match
        assert match.length == longest_earlier(ids), ids
        if match.length:
            assert match.end <= len(ids) - 2
            assert ids[match.end - match.length + 1 : match.end + 1] == ids[len(ids) - match.length :]
    assert context.sam.text == ids


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(-1, 3), min_size=1, max_size=24), st.lists(st.integers(0, 3), max_size=24))
def test_static_match_equals_brute_force(text, stream):
    """A stream followed against a fixed automaton (a corpus, separators included) == rescanning the text."""
    sam = SuffixAutomaton()
    for t in text:
        sam.extend(t)
    match = Match()
    for i, token in enumerate(stream):
        match.advance(sam, token)
        assert match.length == longest_in(stream[: i + 1], text)
        if match.length:
            assert text[match.end - match.length + 1 : match.end + 1] == stream[i + 1 - match.length : i + 1]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 2), min_size=1, max_size=30))
def test_the_automaton_accepts_exactly_the_substrings(text):
    sam = SuffixAutomaton()
    for t in text:
        sam.extend(t)
    assert len(sam.length) <= max(2 * len(text) - 1, 2)  # linear size
    substrings = {tuple(text[i:j]) for i in range(len(text)) for j in range(i + 1, len(text) + 1)}
    for probe in [(a, b, c) for a in range(3) for b in range(3) for c in range(3)] + list(substrings):
        state = 0
        for t in probe:
            state = sam.next[state].get(t, -1)
            if state < 0:
                break
        assert (state >= 0) == (probe in substrings), probe


def sam(**kwargs) -> SamDecoding:
    kwargs.setdefault("aux", "none")
    return SamDecoding(VOCAB, **kwargs)


def drafted(drafter: SamDecoding, ids: list[int]) -> list[int] | None:
    drafter.reset(torch.tensor(ids[:1]), None)
    draft = drafter.propose(ids)
    return None if draft is None else draft.tokens.tolist()


@pytest.mark.parametrize(
    "ids, kwargs, expected",
    [
        ([1, 2, 3, 4, 5, 6, 1, 2, 3], {"threshold": 3, "max_chain": 4}, [4, 5, 6, 1]),  # the match [1 2 3], copied
        ([1, 2, 3, 4, 5, 6, 1, 2, 3], {"threshold": 4}, None),  # a match of 3 < threshold: no draft without aux
        ([7, 1, 2, 9, 3, 1, 2, 8, 7, 1, 2], {"threshold": 2, "max_chain": 3}, [9, 3, 1]),  # the longest match wins
        ([5, 5], {"threshold": 1, "max_chain": 4}, [5, 5, 5, 5]),  # a copy reaching the end goes on through itself
        ([1, 2, 3, 4, 5, 6, 7, 1, 2, 3], {"threshold": 1, "max_chain": 9, "factor": 2.0, "offset": -1}, [4, 5, 6, 7, 1]),
        ([1, 2, 3, 4, 5, 6, 7, 1, 2, 3], {"threshold": 1, "max_chain": 4, "factor": 2.0}, [4, 5, 6, 7]),  # capped
    ],
)
def test_drafts(ids, kwargs, expected):
    assert drafted(sam(**kwargs), ids) == expected


def test_a_copy_in_progress_stays_on_its_source():
    """After [1 2 3] matched the first occurrence and the context went on copying it, the same source is followed."""
    drafter = sam(threshold=2, max_chain=2)
    ids = [1, 2, 3, 4, 9, 1, 2, 3, 5, 8, 1, 2, 3]
    drafter.reset(torch.tensor(ids), None)
    assert drafter.propose(ids).tokens.tolist() == [5, 8]  # re-anchored on the most recent [1 2 3] (a split state)
    ids += [5]
    assert drafter.propose(ids).tokens.tolist() == [8, 1]


def test_below_the_threshold_the_aux_drafts_and_counts_are_kept():
    drafter = SamDecoding(VOCAB, threshold=3, aux_tree="paper-b3")
    drafter.reset(torch.tensor([1, 2, 3, 4, 1, 2]), None)
    draft = drafter.propose([1, 2, 3, 4, 1, 2])  # the match [1 2] is too short
    assert draft.shape is drafter.aux.shape()
    draft = drafter.propose([1, 2, 3, 4, 1, 2, 3])
    assert draft.tokens.tolist()[:2] == [4, 1] and draft.shape.is_chain
    assert drafter.sources == {"aux": 1, "retrieval": 1}


def test_merge_inserts_the_chain_into_the_aux_tree_as_a_trie():
    drafter = SamDecoding(VOCAB, threshold=2, max_chain=4, mode="merge", aux_tree=TREE, k=2)
    m = drafter.aux.matrix
    m[3] = torch.tensor([4, 7])
    m[4] = torch.tensor([5, 8])
    m[7] = torch.tensor([9, 10])
    m[5] = torch.tensor([11, 12])
    ids = [2, 3, 4, 5, 6, 2, 3]
    drafter.reset(torch.tensor(ids), None)
    draft = drafter.propose(ids)  # chain [4 5 6 2]; the aux tree holds [4 5 11] from the root
    aux = drafter.aux.propose(ids)
    assert aux.tokens.tolist() == [4, 7, 5, 8, 9, 11]
    assert draft.tokens.tolist() == [4, 7, 5, 8, 9, 11, 6, 2]
    assert draft.shape.parents == aux.shape.parents + (3, 7)  # under [4 5] (block index 3), then a chain
    assert draft.shape is interned(draft.shape.parents)  # one shape per tree: its device buffers are reused
    assert drafter.sources == {"merged": 1}
    m[5] = torch.tensor([6, 12])  # the aux tree now contains [4 5 6]: the chain adds only [2]
    assert drafter.propose(ids).shape.parents == aux.shape.parents + (6,)


def test_interned_shapes_are_shared_and_the_cache_is_bounded():
    assert interned((0, 0, 1)) is interned((0, 0, 1))
    assert interned.cache_info().maxsize is not None


def test_a_corpus_match_must_beat_the_context_by_the_bias(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("[10, 11, 12, 13, 14]\n\n[20, 21, 22, 23, 24, 25]\n")
    ids = [30, 20, 21, 22]  # no earlier match in the context; [20 21 22] in the corpus
    assert drafted(sam(corpus=str(corpus), bias=0, threshold=3, max_chain=5), ids) == [23, 24, 25]  # ends at the document
    assert drafted(sam(corpus=str(corpus), bias=1, threshold=3), ids) is None  # 3 - bias 1 < threshold 3
    assert drafted(sam(corpus=str(corpus), bias=1, threshold=2, max_chain=2), ids) == [23, 24]
    ids = [13, 9, 13]  # the context's own [13] (1) vs the corpus's [13] (1 - bias): the context wins
    assert drafted(sam(corpus=str(corpus), bias=0, threshold=1, max_chain=2), ids) == [9, 13]
    assert sam(corpus=str(corpus)).describe()["corpus_tokens"] == 13  # 11 tokens + 2 document separators


def run(model, drafter: Drafter, prompt: list[int], n: int):
    return Engine(model, set()).generate(prompt, drafter, n)


VARIANTS = [
    {"aux": "none", "threshold": 1},
    {"aux": "none", "threshold": 2, "factor": 1.0, "offset": 1, "max_chain": 6},
    {"aux": "recycling", "threshold": 2},
    {"aux": "recycling", "threshold": 1, "mode": "merge", "aux_tree": "paper-b4"},
    {"aux": "recycling", "threshold": 2, "mode": "merge", "max_chain": 4},
]


@pytest.mark.device
@pytest.mark.parametrize("model", ["llama", "gemma3"])  # gemma3: sliding window 8, crossed by every context here
@pytest.mark.parametrize("kwargs", VARIANTS, ids=lambda k: "-".join(f"{a}={b}" for a, b in k.items()))
def test_output_equals_greedy_on_random_prompts(model, kwargs, request):
    net = request.getfixturevalue(model)
    rng = random.Random(f"sam-{model}")
    drafter = SamDecoding(VOCAB, DEVICE, **kwargs)  # one drafter for all prompts: the aux matrix stays hot
    for _ in range(4):
        prompt = [rng.randrange(8) for _ in range(rng.randint(1, 24))]  # a small alphabet: many matches
        n = rng.randint(1, 48)
        assert run(net, drafter, prompt, n).output_ids == run(net, Drafter(VOCAB), prompt, n).output_ids, prompt
    assert drafter.sources["retrieval"] + drafter.sources["merged"] > 0


@pytest.mark.device
@pytest.mark.parametrize("mode", ["switch", "merge"])
def test_retrieval_is_accepted_and_the_aux_observes_every_step(llama, mode):
    prompt = [3, 17, 42, 8, 3, 17, 42, 8, 3, 17]
    drafter = SamDecoding(VOCAB, DEVICE, threshold=2, mode=mode)
    observed = []
    observe = drafter.aux.observe

    def spy(step):
        observe(step)
        observed.append(step)
        position = int(step.accepted[-1])  # the aux learned from this block, whoever drafted it
        top = step.logits[position].topk(drafter.aux.k).indices
        assert drafter.aux.matrix[int(step.tokens[position])].tolist() == top.tolist()

    drafter.aux.observe = spy
    gen = run(llama, drafter, prompt, 48)
    assert gen.output_ids == run(llama, Drafter(VOCAB), prompt, 48).output_ids
    assert len(observed) == gen.decoding_steps
    source = "retrieval" if mode == "switch" else "merged"
    assert drafter.sources[source] > 0 and sum(drafter.sources.values()) == gen.decoding_steps
    assert gen.drafter_stats["sources"] == {k: v for k, v in drafter.sources.items() if v}  # recorded per turn
    assert any(s.shape.is_chain and s.shape.n_nodes > 1 for s in observed) == (mode == "switch")
    assert sum(gen.accept_lengths) / gen.decoding_steps > 1.5


@pytest.mark.device
@pytest.mark.parametrize("mode", ["switch", "merge"])
def test_a_fallback_without_a_tree_leaves_the_chain_alone(llama, mode):
    drafter = SamDecoding(VOCAB, DEVICE, threshold=2, mode=mode, aux_tree=[])  # as aux_tree=auto where no tree pays
    prompt = [3, 17, 42, 8, 3, 17, 42, 8, 3, 17]
    gen = run(llama, drafter, prompt, 40)
    assert gen.output_ids == run(llama, Drafter(VOCAB), prompt, 40).output_ids
    assert drafter.sources["retrieval"] > 0 and drafter.sources["none"] > 0
    assert drafter.sources["aux"] == drafter.sources["merged"] == 0


def test_hot_state_round_trips_and_sam_alone_has_none(llama):
    a = SamDecoding(VOCAB, threshold=2)
    run(llama, a, [4, 5, 6, 4, 5], 16)
    assert list(a.state_dict()) == ["aux.matrix"]
    b = SamDecoding(VOCAB, threshold=2)
    b.load_state_dict(a.state_dict())
    assert torch.equal(a.aux.matrix, b.aux.matrix) and a.aux.matrix.any()
    assert sam().state_dict() == {}


def test_cold_aux_asks_for_prefill_logits():
    assert not SamDecoding(VOCAB).needs_prefill_logits
    assert TokenRecycling(VOCAB, tree=TREE, start="cold").needs_prefill_logits  # what SAM would delegate


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"threshold": 0}, "method.threshold"),
        ({"max_chain": 0}, "method.max_chain"),
        ({"factor": -1.0}, "method.factor"),
        ({"mode": "both"}, "method.mode"),
        ({"aux": "eagle"}, "method.aux must be one of recycling, none"),
        ({"aux_tree": "nope"}, "method.tree"),
    ],
)
def test_bad_parameters_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamDecoding(VOCAB, **kwargs)


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "no such file"),
        (b"[1, 2]\n[3, 64]\n", "line 2: expected a JSON list of token ids in 0..63"),
        (b"1 2 3\n", "line 1"),
        (b"\n\n", "holds no tokens"),
        (b"\xff\xfe[1]\n", "unreadable"),
    ],
)
def test_a_bad_corpus_is_refused_at_construction(tmp_path, content, message):
    path = tmp_path / "corpus.jsonl"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises((ValueError, FileNotFoundError), match=message) as err:
        SamDecoding(VOCAB, corpus=str(path))
    assert "method.corpus" in str(err.value)


def test_a_missing_corpus_fails_when_the_run_builds_its_drafter(tmp_path):
    with pytest.raises(FileNotFoundError, match="method.corpus=.*no such file"):
        build_drafter(config("method=sam", f"method.corpus={tmp_path / 'nope.jsonl'}").method, VOCAB, "cpu")


def test_a_corpus_is_built_once(tmp_path):
    path = tmp_path / "corpus.jsonl"
    path.write_text("[1, 2, 3]\n")
    assert sam(corpus=str(path)).static is sam(corpus=str(path)).static
    path.write_text("[1, 2, 3, 4]\n")  # a changed file is rebuilt
    assert len(sam(corpus=str(path)).static) == 5


def test_config_label_and_overrides():
    cfg = config("method=sam", "method.threshold=2", "method.mode=merge", "method.aux_tree=paper-b4", "method.k=4")
    assert cfg.method.label == "sam-merge-t2-c10-f0.0-recycling-paper-b4"
    drafter = build_drafter(cfg.method, vocab_size=VOCAB, device="cpu")
    assert drafter.threshold == 2 and drafter.mode == "merge" and drafter.aux.k == 4
    assert drafter.aux.shape().n_nodes == 16
    alone = build_drafter(config("method=sam", "method.aux=none").method, vocab_size=VOCAB, device="cpu")
    assert alone.aux is None and alone.mode == "merge"  # nothing to merge with: the chain alone, as switch
    ids = [2, 3, 4, 5, 6, 7, 2, 3, 4, 5]
    alone.reset(torch.tensor(ids), None)
    assert alone.propose(ids).tokens.tolist()[:3] == [6, 7, 2] and alone.propose(ids).shape.is_chain


def test_the_analysis_reports_the_share_of_steps_by_draft_source(tmp_path, capsys):
    folder = tmp_path / "results" / "tiny" / "mini"
    folder.mkdir(parents=True)
    header = {"model": "tiny", "data": "mini", "dtype": "float32", "device": "cpu", "max_new_tokens": 8,
              "question_ids": [1, 2]}
    choice = {"turns": ["x"], "new_tokens": [4], "wall_time": [1.0], "decoding_steps": [3], "output_ids": [[1] * 4],
              "accept_lengths": [1, 1, 1]}
    stats = {1: [{"sources": {"retrieval": 1, "aux": 2}}], 2: [{"sources": {"aux": 1}}, {"sources": {"none": 2}}]}
    for label in ("baseline", "sam"):
        records = [{"question_id": q, "category": category, "choices": [choice if label == "baseline" else
                                                                       dict(choice, drafter_stats=stats[q])]}
                   for q, category in ((1, "qa"), (2, "translation"))]
        (folder / f"{label}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        (folder / f"{label}.meta.json").write_text(json.dumps({**header, "method": label, "label": label}))
    comparisons, _ = analysis.pair_runs(analysis.load_runs([folder]))
    table = steps.sources(comparisons).set_index("group")
    assert set(table["label"]) == {"sam"}  # the baseline reports no sources
    overall = table.loc[analysis.OVERALL]
    assert overall["steps"] == 6 and overall["retrieval"] == pytest.approx(1 / 6) and overall["aux"] == 0.5
    assert table.loc[group_of("translation"), "none"] == pytest.approx(2 / 3)
    assert speedup.main([str(folder), "--out", str(tmp_path / "tables")]) == 0
    assert "Draft sources" in capsys.readouterr().out
    assert (tmp_path / "tables" / "sources.csv").is_file()


# mode=auto: the per-class policy, its statistics and its search

@pytest.mark.device
@pytest.mark.parametrize("kwargs", [
    {"aux": "none", "threshold": 1, "max_chain": 6, "mode": "switch"},
    {"aux": "recycling", "threshold": 1, "max_chain": 6, "mode": "merge"},
], ids=["sam-alone", "merged-with-recycling"])
def test_scored_depths_are_what_verifying_the_scored_drafts_accepts(llama, kwargs):
    """With the scored chain and aux tree verified (merged), every step accepts max(chain depth, aux depth)."""
    prompt = [3, 17, 42, 8, 3, 17, 42, 8, 3, 17, 5, 3, 17]
    drafter = SamDecoding(VOCAB, DEVICE, score=6, **kwargs)
    gen = run(llama, drafter, prompt, 40)
    assert gen.output_ids == run(llama, Drafter(VOCAB), prompt, 40).output_ids
    scored = {tuple(map(int, k.split(":"))): n for k, n in gen.drafter_stats["policy_shadow"].items()}
    assert sum(scored.values()) == gen.decoding_steps
    assert sum(n * max(c, a) for (_, c, a), n in scored.items()) == sum(gen.accept_lengths) - gen.decoding_steps
    assert any(c for _, c, _ in scored) and (kwargs["aux"] == "none") == (not any(a for _, _, a in scored))
    plain = SamDecoding(VOCAB, DEVICE, **kwargs)  # scoring changes nothing that is verified
    again = run(llama, plain, prompt, 40)
    assert again.accept_lengths == gen.accept_lengths and plain.sources == drafter.sources


def test_a_policy_verifies_by_match_length_and_context():
    chain4, aux = StepOption(False, 4), StepOption(True, 0)
    short = PolicyChoice((StepOption(False, 0), aux, chain4), 0, 1.0, 1.0, 1.0, 1.0)  # class 2 and above: chain 4
    long = PolicyChoice((StepOption(False, 0),), 0, 1.0, 1.0, 1.0, 1.0)  # nothing at all
    drafter = SamDecoding(VOCAB, mode=PolicyPlan((short, long), bounds=(30,)), aux_tree=TREE)
    drafter.reset(torch.tensor([5, 6, 7, 8, 9, 5, 6]), None)
    draft = drafter.propose([5, 6, 7, 8, 9, 5, 6])  # match "5 6" (2 tokens): the chain of 4
    assert draft.tokens.tolist() == [7, 8, 9, 5] and draft.shape.is_chain
    assert drafter.propose([5, 6, 7, 8, 9, 5, 6, 1, 6]).shape.n_nodes == len(TREE) + 1  # match "6": the aux tree
    assert drafter.propose([5, 6, 7, 8, 9, 5, 6, 1, 6, 2]) is None  # no match: nothing
    assert drafter.propose(list(range(40)) + [5, 6]) is None  # a long context: nothing
    assert drafter.sources == {"retrieval": 1, "aux": 1, "none": 2}
    assert drafter.describe()["policy"]["buckets"][0]["by_class"] == {"0": "none", "1": "aux", "2+": "chain 4"}


def test_the_policy_search_finds_the_best_option_per_class_by_brute_force():
    rng = random.Random(7)
    for trial in range(30):
        counts = {m: {(rng.randint(0, 3), rng.randint(0, 2)): rng.randint(1, 9) for _ in range(3)}
                  for m in rng.sample(range(5), 3)}
        per_token = rng.choice([0.05, 0.2, 0.6])
        cost = lambda q: 1 + per_token * (q - 1) + (0.3 if q == 4 else 0)  # a size slower than its neighbours
        aux_nodes = rng.choice([0, 2])
        got = best_policy(counts, cost, aux_nodes, max_chain=3, confidence=0.0)  # the search alone: by point estimates
        options = [StepOption(a, c) for a in ((False, True) if aux_nodes else (False,)) for c in range(4)]
        best = 0.0
        for chosen in itertools.product(options, repeat=len(counts)):
            tokens = seconds = 0.0
            for (m, table), o in zip(counts.items(), chosen):
                for (c, a), n in table.items():
                    tokens += n * (1 + max(min(c, o.chain), a if o.aux else 0))
                    seconds += n * cost(1 + o.chain + (aux_nodes if o.aux else 0))
            best = max(best, tokens / seconds)
        assert got.tokens_per_s == pytest.approx(best), trial
        unseen = [m for m in range(MAX_CLASS + 1) if m not in counts and m > min(counts)]
        for m in unseen:  # a class never seen takes the option of the nearest seen class below it
            assert got.option(m) == got.option(max(k for k in counts if k < m))
