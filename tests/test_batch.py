"""Batched speculative decoding (methods.batch) is lossless per row: every row's output equals its request's output
at batch size 1, whatever the other rows hold, for every method, with continuous refill, under sampling too."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from conftest import DEVICE, VOCAB, tiny_gemma3, tiny_llama, tiny_qwen2, tiny_qwen3
from test_engine import RandomTrees
from evaluation.host_syncs import HostSyncs
from methods.batch import BatchEngine, BatchUnsupported, Request, run_batch
from methods.costs import CostCurve
from methods.drafter import Drafter, Step
from methods.eagle import Eagle
from methods.engine import Engine
from methods.lookahead import Lookahead
from methods.online import AdaptivePolicyPlan, AdaptiveTreePlan
from methods.pld import PromptLookup
from methods.recycling import TokenRecycling
from methods.sam import SamDecoding
from methods.sampling import Sampling
from methods.tree_search import NodeStats

pytestmark = pytest.mark.device  # every model and draft on conftest.DEVICE

MODELS = {"llama": tiny_llama(), "qwen2": tiny_qwen2(), "qwen3": tiny_qwen3()}
EOS = {7}  # rows end at different steps: at a stop token or at their budget


def questions(seed: int, n: int = 7) -> list[tuple[list[int], int]]:
    """``n`` (prompt, budget) pairs: prompts of 1 to 30 tokens (some repeating, for the copying drafters), budgets of
    1 to 40 tokens."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        head = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 12))]
        prompt = (head * rng.randrange(1, 4))[:30]
        out.append((prompt, rng.randrange(1, 41)))
    return out


def session(index: int, prompt: list[int], budget: int, out: list):
    """A question of two turns: turn 2's prompt holds turn 1's answer, as evaluation.run's sessions do."""
    first = yield Request(prompt, budget, key=2 * index)
    out.append(first.output_ids)
    second = yield Request(prompt + first.output_ids + [3, 4, 5], budget, key=2 * index + 1)
    out.append(second.output_ids)


def one_by_one(engine: Engine, qs, drafter: Drafter) -> list[list[list[int]]]:
    """Every question's turns at batch size 1 (Engine.generate), through the same sessions."""
    outs = []
    for i, (prompt, budget) in enumerate(qs):
        out: list = []
        turns = session(i, prompt, budget, out)
        request = next(turns)
        try:
            while True:
                request = turns.send(engine.generate(request.prompt_ids, drafter, request.max_new_tokens, request.key))
        except StopIteration:
            outs.append(out)
    return outs


def batched(engine: BatchEngine, qs, drafter: Drafter) -> list[list[list[int]]]:
    outs: list[list] = [[] for _ in qs]
    run_batch(engine, (session(i, p, b, outs[i]) for i, (p, b) in enumerate(qs)), drafter)
    return outs


class KeyedRandomTrees(RandomTrees):
    """test_engine's random trees (each node the true continuation with probability ``hit``), knowing every
    request's batch-1 output by its key (a row learns its own in ``begin``): deep, branching, non-contiguous accepted
    paths in every row, rows of different tree sizes in one step."""

    def __init__(self, references: dict[int, list[int]], seed: int, hit: float = 0.6, extras: bool = True):
        super().__init__([], 0, seed, hit, extras)
        self.references, self.seed = references, seed

    def shared(self):
        return [self.references]

    def begin(self, sampling, key):
        super().begin(sampling, key)
        self.reference, self.rng = self.references[key], random.Random(self.seed * 1000 + key)

    def reset(self, prompt, prefill_logits, prefill_hidden=None):
        self.prompt_len = len(prompt)


def references(engine: Engine, qs) -> dict[int, list[int]]:
    """Every request's batch-1 output by its key."""
    found = {}
    for i, out in enumerate(one_by_one(engine, qs, Drafter(VOCAB, DEVICE))):
        found[2 * i], found[2 * i + 1] = out
    return found


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("batch", [2, 4])
@pytest.mark.parametrize("seed", range(3))
def test_random_trees_in_every_row_are_lossless(name, batch, seed):
    model = MODELS[name]
    qs = questions(seed)
    want = one_by_one(Engine(model, EOS), qs, Drafter(VOCAB, DEVICE))
    got = batched(BatchEngine(Engine(model, EOS), batch), qs, KeyedRandomTrees(references(Engine(model, EOS), qs), seed))
    assert got == want


def curve(per_token_ms: float = 2.0) -> CostCurve:
    """A synthetic calibration: 20 ms a step, ``per_token_ms`` more per token."""
    sizes, contexts = tuple(range(1, 33)), (16, 128)
    samples = [[[20 + per_token_ms * (q - 1)] * 3 for q in sizes] for _ in contexts]
    return CostCurve.from_samples(contexts, sizes, samples)


PROBS = {(0,): 0.6, (1,): 0.2, (0, 0): 0.4, (0, 1): 0.1, (0, 0, 0): 0.25, (2,): 0.05}


def online_tree() -> AdaptiveTreePlan:
    """tree=auto as the harness makes it (a plan that corrects itself from every row's steps), on synthetic inputs."""
    cost = curve()
    return AdaptiveTreePlan(NodeStats(PROBS, steps=100), lambda c, correction=None: cost.at(c, None, correction), (16, 128),
                            every=4, prior_steps=2)


def online_policy(aux_nodes: int) -> AdaptivePolicyPlan:
    cost = curve()
    counts = {0: {(0, 1): 30, (0, 0): 30}, 4: {(3, 1): 40, (0, 0): 10}}
    return AdaptivePolicyPlan(counts, lambda c, correction=None: cost.at(c, None, correction), (16, 128),
                              aux_nodes=lambda c: aux_nodes, max_chain=6, every=4)


METHODS = {
    "baseline": lambda: Drafter(VOCAB, DEVICE),
    "recycling": lambda: TokenRecycling(VOCAB, DEVICE, tree="paper-b3"),
    "recycling-cold": lambda: TokenRecycling(VOCAB, DEVICE, tree="paper-b4", start="cold"),
    "recycling-auto": lambda: TokenRecycling(VOCAB, DEVICE, tree=online_tree()),
    "pld": lambda: PromptLookup(VOCAB, DEVICE, num_pred_tokens=4),
    "lookahead": lambda: Lookahead(VOCAB, DEVICE, N=3, W=3, G=2),
    "sam": lambda: SamDecoding(VOCAB, DEVICE, threshold=2, max_chain=4),
    "sam-merge": lambda: SamDecoding(VOCAB, DEVICE, mode="merge", threshold=2, max_chain=4),
    "sam-auto": lambda: SamDecoding(VOCAB, DEVICE, mode=online_policy(6), aux_tree="paper-b2"),
    "eagle-static": lambda: Eagle(VOCAB, DEVICE, head="random", tree="paper-b3"),
    "eagle-dynamic": lambda: Eagle(VOCAB, DEVICE, head="random", tree="dynamic", total_tokens=8, depth=3, top_k=2),
}


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("batch", [2, 4])
def test_every_method_is_lossless_batched(method, batch):
    model = MODELS["llama"]
    qs = questions(10 + batch)
    want = one_by_one(Engine(model, EOS), qs, Drafter(VOCAB, DEVICE))
    drafter = METHODS[method]()
    engine = BatchEngine(Engine(model, EOS), batch)
    assert batched(engine, qs, drafter) == want
    assert batched(engine, qs, drafter) == want  # again: hot-start state and the slab carried over


@pytest.mark.parametrize("method", ["baseline", "recycling", "pld", "sam-merge", "eagle-static"])
@pytest.mark.parametrize("rule", [Sampling(temperature=1.0), Sampling(temperature=0.7, top_k=8, top_p=0.9, seed=3)])
def test_sampling_is_lossless_per_row(method, rule):
    """Each row samples with its own request's key: its output is that request's at batch size 1."""
    model = MODELS["llama"]
    qs = questions(5)
    want = one_by_one(Engine(model, EOS, sampling=rule), qs, Drafter(VOCAB, DEVICE))
    assert batched(BatchEngine(Engine(model, EOS, sampling=rule), 3), qs, METHODS[method]()) == want


def test_rows_share_the_hot_start_matrix_and_keep_their_own_state():
    drafter = TokenRecycling(VOCAB, DEVICE, tree="paper-b3")
    rows = BatchEngine(Engine(MODELS["llama"], EOS), 3).slot_drafters(drafter)
    assert rows[0] is drafter and all(r.matrix is drafter.matrix and r.plan is drafter.plan for r in rows)
    assert len({id(r._tokens) for r in rows}) == 3
    sam = SamDecoding(VOCAB, DEVICE)
    other = sam.fork()
    assert other.aux is not sam.aux and other.aux.matrix is sam.aux.matrix and other.context is not sam.context


def test_a_forward_skips_the_idle_rows_after_the_last_busy_one():
    """Three questions on four rows: the last row never holds one, and no forward feeds it."""
    engine = BatchEngine(Engine(MODELS["llama"], EOS), 4)
    fed = []
    model = engine.engine.model
    hook = model.register_forward_pre_hook(lambda m, args, kwargs: fed.append(kwargs["input_ids"].shape[0]),
                                           with_kwargs=True)
    try:
        qs = [([1, 2, 3], 20), ([9, 8], 20), ([5, 5, 5, 5], 20)]
        assert batched(engine, qs, Drafter(VOCAB, DEVICE)) == one_by_one(Engine(model, EOS), qs, Drafter(VOCAB, DEVICE))
    finally:
        hook.remove()
    assert max(fed) == 3


class RowsSeen(Drafter):
    """Records the rows every step it observes was shared by (a class list: every fork appends to the same)."""

    seen: list[int] = []

    def observe(self, step: Step) -> None:
        self.seen.append(step.rows)


def test_every_row_of_a_step_is_told_how_many_rows_shared_it():
    """A plan counts a batch's step once (its time is the same step for every row): each of the r busy rows of a
    step reports rows = r."""
    RowsSeen.seen = []
    qs = [([1, 2, 3], 12), ([9, 8], 5), ([5, 5, 5, 5], 20)]
    batched(BatchEngine(Engine(MODELS["llama"], EOS), 4), qs, RowsSeen(VOCAB, DEVICE))
    counts = Counter(RowsSeen.seen)
    assert counts[3] and set(counts) <= {1, 2, 3} and all(n % rows == 0 for rows, n in counts.items())


def test_a_request_that_fails_goes_back_to_its_session_and_the_others_go_on():
    model = MODELS["llama"]
    engine = BatchEngine(Engine(model, EOS, max_length=40), 2)
    failed: list = []

    def asks(prompt, out):
        try:
            gen = yield Request(prompt, 5)
            out.append(gen.output_ids)
        except ValueError as err:  # PromptTooLong
            failed.append(str(err))

    outs: list[list] = [[], [], []]
    prompts = [[1, 2, 3], list(range(45)), [4, 5, 6, 1]]
    run_batch(engine, (asks(p, o) for p, o in zip(prompts, outs)), Drafter(VOCAB, DEVICE))
    reference = Engine(model, EOS, max_length=40)
    assert outs[0] == [reference.generate([1, 2, 3], Drafter(VOCAB, DEVICE), 5).output_ids]
    assert outs[2] == [reference.generate([4, 5, 6, 1], Drafter(VOCAB, DEVICE), 5).output_ids]
    assert outs[1] == [] and "no room for an answer" in failed[0]


def test_generations_record_their_row_and_the_engines_clock():
    engine = BatchEngine(Engine(MODELS["llama"], EOS), 2)
    gens: list = []

    def asks(prompt):
        gens.append((yield Request(prompt, 12)))

    run_batch(engine, (asks(p) for p, _ in questions(1, n=4)), Drafter(VOCAB, DEVICE))
    assert sorted({g.slot for g in gens}) == [0, 1]
    for g in gens:
        assert 0 <= g.started < g.finished <= engine.clock
        assert g.wall_time == pytest.approx(g.finished - g.started)


def test_sliding_window_models_are_refused_clearly():
    with pytest.raises(BatchUnsupported, match="sliding-window.*batch_size=1"):
        BatchEngine(Engine(tiny_gemma3(), set()), 2)


@pytest.mark.parametrize("method", ["baseline", "recycling"])
def test_one_host_read_per_step_for_the_whole_batch(method):
    """The floor of batch size 1, for the batch: one read per step (every row's accepted path and bonus token);
    besides, each prefill writes its prompt and reads its first token."""
    engine = BatchEngine(Engine(MODELS["llama"], EOS), 3)
    qs = questions(2, n=5)
    drafter = METHODS[method]()
    batched(engine, qs, drafter)  # the shapes built, the slab grown
    syncs = HostSyncs()
    outs: list[list] = [[] for _ in qs]
    with syncs:
        steps = sum(1 for _ in engine.serve((session(i, p, b, outs[i]) for i, (p, b) in enumerate(qs)), drafter))
    requests = 2 * len(qs)
    assert steps > 5 and syncs.events == {"tolist": steps, "int": requests, "tensor(data)": requests}


def test_a_batched_warm_up_records_every_plan_change_it_made_for_the_run():
    """The warm-up's rows share the run's plan, so a change made while warming up is the run's and is recorded with
    its first answer (evaluation.run). At B rows each row's report holds the changes since another row's: they were
    lost at B > 1 (SAM mode=auto at 8 rows stopped drafting while warming up, unrecorded)."""
    from evaluation.run import _ask

    cost = curve(per_token_ms=6.0)
    pessimistic = NodeStats({(0,) * d: 0.1 * 0.9 ** d for d in range(1, 9)} | {(1,): 0.02}, steps=1000)
    plan = AdaptiveTreePlan(pessimistic, lambda c, correction=None: cost.at(c, None, correction), (16, 128), every=4,
                            prior_steps=2, rows=2)
    drafter = TokenRecycling(VOCAB, DEVICE, tree=plan)
    engine, kept = BatchEngine(Engine(MODELS["llama"], EOS), 2), []
    for _ in range(3):
        run_batch(engine, (_ask(Request([3, 4, 5, 6] * 3, 60), kept) for _ in range(2)), drafter)
    assert plan.version >= 1 and sum(len(stats["plan_changes"]) for stats in kept) == plan.version
