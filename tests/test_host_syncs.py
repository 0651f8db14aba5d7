"""Host syncs per decoding step, pinned per method: what would make a step wait for a GPU (evaluation.host_syncs).

The floor is one read per step (the accepted path and the bonus token); the baseline, Token Recycling and EAGLE's
static tree stay at it. The others need the host for what they draft from: PLD's and SAM's copied chains and
Lookahead's window are host lists (a write each time they draft, Lookahead also a read of its window's update),
SAM's trie merge reads the fallback tree's tokens, EAGLE-2's dynamic tree is chosen on the host (two reads and a
write). A new tree shape's buffers are built once and cached (methods.tree), never per step.
"""

from __future__ import annotations

from collections import Counter

import pytest

from conftest import VOCAB, tiny_llama
from evaluation.host_syncs import HostSyncs
from methods.drafter import Drafter, Step
from methods.eagle import Eagle
from methods.engine import Engine
from methods.lookahead import Lookahead
from methods.pld import PromptLookup
from methods.recycling import TokenRecycling
from methods.sam import SamDecoding

PROMPT = [1, 2, 3, 4, 5, 6, 7, 1, 2, 3, 4, 5, 6, 7, 1, 2, 3]  # repeats: the copying drafters find matches


class Counted:
    """A drafter whose steps, from its propose to its observe (the engine's whole step), are counted."""

    def __init__(self, drafter: Drafter, syncs: HostSyncs):
        self.drafter, self.syncs, self.steps, self.drafting = drafter, syncs, 0, 0

    def __getattr__(self, name: str) -> object:
        return getattr(self.drafter, name)

    def propose(self, ids: list[int]):
        self.syncs.counting = True
        return self.drafter.propose(ids)

    def observe(self, step: Step) -> None:
        self.drafter.observe(step)
        self.syncs.counting = False
        self.steps += 1
        self.drafting += step.shape.n_nodes > 1


def steady_state(drafter: Drafter, tokens: int = 40) -> tuple[Counter, Counted, dict]:
    """Host syncs of a second generation (the first builds the shapes a drafter reuses)."""
    engine, syncs = Engine(tiny_llama(), set()), HostSyncs()
    engine.generate(PROMPT, drafter, 8)
    counted = Counted(drafter, syncs)
    syncs.counting = False
    with syncs:
        gen = engine.generate(PROMPT, counted, tokens)
    return syncs.events, counted, gen.drafter_stats


@pytest.mark.parametrize("drafter", [Drafter(VOCAB), TokenRecycling(VOCAB, tree="paper"),
                                     TokenRecycling(VOCAB, tree="paper-b4", start="cold")],
                         ids=["baseline", "recycling", "recycling-cold"])
def test_baseline_and_token_recycling_read_the_host_once_per_step(drafter):
    events, counted, _ = steady_state(drafter)
    assert counted.steps > 5 and events == {"tolist": counted.steps}


def test_eagle_static_reads_once_per_step_and_writes_once_per_generation():
    events, counted, _ = steady_state(Eagle(VOCAB, head="random", tree="paper-b3"))
    # the answer's first token (from the prefill) for the head's catch-up; its own KV cache's two empty tensors
    assert events == {"tolist": counted.steps, "tensor(data)": 3}


def test_eagle_dynamic_chooses_its_tree_on_the_host():
    events, counted, _ = steady_state(Eagle(VOCAB, head="random", tree="dynamic", total_tokens=8, depth=3, top_k=2))
    assert events == {"tolist": 3 * counted.steps, "tensor(data)": counted.steps + 3}


def test_pld_writes_its_chain_when_it_drafts():
    events, counted, _ = steady_state(PromptLookup(VOCAB))
    assert 0 < counted.drafting < counted.steps
    assert events == {"tolist": counted.steps, "tensor(data)": counted.drafting}


def test_lookahead_writes_its_window_and_reads_its_update_every_step():
    events, counted, _ = steady_state(Lookahead(VOCAB))
    assert events == {"tolist": 2 * counted.steps, "tensor(data)": counted.steps}


def test_sam_writes_a_retrieved_chain_and_reads_the_tree_it_merges_into():
    events, counted, stats = steady_state(SamDecoding(VOCAB, mode="switch"))
    assert events == {"tolist": counted.steps, "tensor(data)": stats["sources"].get("retrieval", 0)}
    events, counted, stats = steady_state(SamDecoding(VOCAB, mode="merge"))
    merged, retrieved = stats["sources"].get("merged", 0), stats["sources"].get("retrieval", 0)
    assert merged and events["tolist"] == counted.steps + merged
    assert events["tensor(data)"] <= merged + retrieved and set(events) == {"tolist", "tensor(data)"}


def test_the_counter_sees_what_syncs():
    import torch

    with HostSyncs() as syncs:
        t = torch.arange(4)
        t[torch.tensor(1)] = 5  # a 0-dim index (and the tensor made from host data)
        t[1] = 3  # a host number written in
        int(t.sum()), t.tolist(), bool(t.any()), t.nonzero(), t[t > 1]
        t.index_select(0, torch.arange(2))  # stays on the device: not counted
    assert syncs.events == {"tensor(data)": 1, "indexing with a 0-dim or boolean tensor": 2,
                            "setitem(python number)": 1, "int": 1, "tolist": 1, "bool": 1, "nonzero": 1}
