"""Host syncs per decoding step, pinned per method: what would make a step wait for a GPU (evaluation.host_syncs).

The floor is one read per step (the accepted path and the bonus token); the baseline, Token Recycling and EAGLE's
static tree stay at it. The others need the host for what they draft from: PLD's and SAM's copied chains and
Lookahead's window are host lists (a write each time they draft, Lookahead also a read of its window's update),
SAM's trie merge reads the fallback tree's tokens, EAGLE-2's dynamic tree is chosen on the host (two reads and a
write). A new tree shape's buffers are built once and cached (methods.tree), never per step. The rules are
``evaluation.host_syncs.PINNED``, which ``make gpu-check`` holds the methods to on a GPU too (these tests are
marked ``device``), and docs/gpu.md's table is made from them.
"""

from __future__ import annotations

import pytest
import torch

from conftest import DEVICE, VOCAB, tiny_llama
from evaluation.host_syncs import PINNED, Counts, HostSyncs, count, markdown_table
from methods.engine import Engine
from methods.paths import PROJECT_ROOT


def steady_state(name: str) -> Counts:
    return count(Engine(tiny_llama(), set()), PINNED[name].build(VOCAB, DEVICE))


@pytest.mark.device
@pytest.mark.parametrize("name", PINNED)
def test_every_method_syncs_as_pinned(name):
    counts = steady_state(name)
    assert counts.steps > 5 and PINNED[name].mismatches(counts) == []


def test_the_floor_is_one_read_per_step():
    """The baseline, Token Recycling and EAGLE's static tree at the floor, written out: their rules cannot drift."""
    facts = {"steps": 10, "drafting": 10, "generation": 1}
    for name in ("baseline", "recycling", "recycling-cold"):
        assert PINNED[name].bounds(facts) == ({"tolist": 10}, {})
    assert PINNED["eagle-static"].bounds(facts) == ({"tolist": 10, "tensor(data)": 3}, {})


@pytest.mark.device
def test_pld_drafts_on_some_steps_only():
    """So that its rule is held on steps that write a chain and steps that do not."""
    counts = steady_state("pld")
    assert 0 < counts.drafting < counts.steps and counts.events["tensor(data)"] == counts.drafting


@pytest.mark.device
def test_sam_merge_merges_and_writes():
    counts = steady_state("sam-merge")
    assert counts.sources.get("merged", 0) > 0
    assert set(counts.events) == {"tolist", "tensor(data)"}


def test_a_rule_departed_from_is_named():
    counts = Counts(events={"tolist": 7, "item": 1}, steps=6, drafting=2, sources={})
    assert PINNED["baseline"].mismatches(counts) == ["item: 1, expected 0", "tolist: 7, expected 6"]
    merged = Counts(events={"tolist": 9, "tensor(data)": 6}, steps=6, drafting=6, sources={"merged": 3, "retrieval": 2})
    assert PINNED["sam-merge"].mismatches(merged) == ["tensor(data): 6, more than 5"]


def test_docs_gpu_holds_the_pinned_table():
    text = (PROJECT_ROOT / "docs" / "gpu.md").read_text(encoding="utf-8")
    assert f"\n{markdown_table()}\n" in text, (
        "docs/gpu.md's host-sync table differs from evaluation.host_syncs.PINNED: paste the output of "
        "`python -c 'from evaluation.host_syncs import markdown_table; print(markdown_table())'` in its place")


def test_the_counter_sees_what_syncs():
    with HostSyncs() as syncs:
        t = torch.arange(4)
        t[torch.tensor(1)] = 5  # a 0-dim index (and the tensor made from host data)
        t[1] = 3  # a host number written in
        int(t.sum()), t.tolist(), bool(t.any()), t.nonzero(), t[t > 1]
        t.index_select(0, torch.arange(2))  # stays on the device: not counted
    assert syncs.events == {"tensor(data)": 1, "indexing with a 0-dim or boolean tensor": 2,
                            "setitem(python number)": 1, "int": 1, "tolist": 1, "bool": 1, "nonzero": 1}
