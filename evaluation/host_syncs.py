"""Counting what would make a decoding step wait for the GPU, on any device (a CPU too).

On CUDA the host queues kernels ahead of the device until something needs a value back (``.item()``,
``.tolist()``, ``bool(t)``, indexing with a 0-dim or boolean tensor, ``nonzero``) or sends one over from Python
data (``torch.tensor(list)`` on the device, ``t[i] = 5``): each such call stalls the queue. A speculative step
needs one read, the accepted path; the others can stay on the device. :class:`HostSyncs` counts them with a
``TorchFunctionMode``; :data:`PINNED` says what each method may do per step, the tests hold every method to it
on a CPU (tests/test_host_syncs.py, so a regression fails CI) and ``make gpu-check`` on a GPU, where
``torch.cuda.set_sync_debug_mode`` also gives the device's own count (:func:`count`).
"""

from __future__ import annotations

import warnings
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch
from torch.overrides import TorchFunctionMode

from methods.drafter import Drafter, Step
from methods.eagle import Eagle
from methods.engine import Engine
from methods.lookahead import Lookahead
from methods.pld import PromptLookup
from methods.recycling import TokenRecycling
from methods.sam import SamDecoding
from methods.tree import Draft

_READS = {torch.Tensor.item: "item", torch.Tensor.tolist: "tolist", torch.Tensor.__bool__: "bool",
          torch.Tensor.__int__: "int", torch.Tensor.__float__: "float", torch.Tensor.__index__: "index",
          torch.Tensor.cpu: "cpu", torch.Tensor.numpy: "numpy", torch.Tensor.nonzero: "nonzero",
          torch.nonzero: "nonzero", torch.masked_select: "masked_select", torch.Tensor.masked_select: "masked_select"}
_WRITES = {torch.tensor: "tensor(data)", torch.as_tensor: "as_tensor(data)", torch.Tensor.new_tensor: "new_tensor"}
_INDEXING = (torch.Tensor.__getitem__, torch.Tensor.__setitem__)


def _host_index(index: Any) -> bool:
    """An index whose result size or position needs a device value on the host: a 0-dim or boolean tensor."""
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and (i.dim() == 0 or i.dtype == torch.bool) for i in parts)


class HostSyncs(TorchFunctionMode):
    """Counts host reads and writes while active and ``counting``; ``events`` names each kind."""

    def __init__(self) -> None:
        super().__init__()
        self.counting = True
        self.events: Counter[str] = Counter()

    @property
    def total(self) -> int:
        return sum(self.events.values())

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.counting:
            if func in _READS:
                self.events[_READS[func]] += 1
            elif func in _WRITES and not isinstance(args[0] if args else kwargs.get("data"), torch.Tensor):
                self.events[_WRITES[func]] += 1
            elif func in _INDEXING and _host_index(args[1]):
                self.events["indexing with a 0-dim or boolean tensor"] += 1
            elif func is torch.Tensor.__setitem__ and isinstance(args[2], (int, float, bool)):
                self.events["setitem(python number)"] += 1
        return func(*args, **kwargs)


# What torch.cuda.set_sync_debug_mode("warn") says at every call that makes the host wait for the device.
DEVICE_SYNC_WARNING = "called a synchronizing CUDA operation"
# A prompt that repeats, so that the copying drafters (PLD, SAM, Lookahead's pool) find matches and draft.
PROMPT = [1, 2, 3, 4, 5, 6, 7, 1, 2, 3, 4, 5, 6, 7, 1, 2, 3]


@dataclass
class Counts:
    """Host syncs over the steps of one generation (from each ``propose`` to its ``observe``: the engine's whole
    step), and the facts a :class:`Pinned` rule counts in."""

    events: Counter[str]  # HostSyncs' events
    steps: int
    drafting: int  # steps that verified a draft
    sources: dict[str, int]  # the drafter's own counters (SAM: where each draft came from)
    device: int | None = None  # the device's own count of synchronising calls (CUDA), else None

    def facts(self) -> dict[str, int]:
        return {"steps": self.steps, "drafting": self.drafting, "generation": 1, **self.sources}


# How a fact reads in a rule: "1 per step", "3 per generation".
_UNITS = {"steps": "step", "drafting": "step that drafts", "generation": "generation",
          "retrieval": "retrieved chain", "merged": "merged draft"}


@dataclass(frozen=True)
class Pinned:
    """What a method's steps may read from or write to the host in one generation, by :class:`HostSyncs` event: a
    sum of the generation's facts (:meth:`Counts.facts`) times coefficients. ``exact`` events must match,
    ``at_most`` ones stay at or below their bound, and any other event is one too many."""

    build: Callable[[int, torch.device], Drafter]  # the drafter, from the vocabulary size and the device
    drafter: str  # how it is built, for the table
    why: str  # what the syncs are, for the table
    exact: Mapping[str, Mapping[str, int]]
    at_most: Mapping[str, Mapping[str, int]] = field(default_factory=dict)

    def bounds(self, facts: Mapping[str, int]) -> tuple[dict[str, int], dict[str, int]]:
        """The exact counts and the upper bounds for a generation with these facts."""
        def total(terms: Mapping[str, int]) -> int:
            return sum(k * facts.get(fact, 0) for fact, k in terms.items())
        return ({e: total(t) for e, t in self.exact.items()}, {e: total(t) for e, t in self.at_most.items()})

    def expected(self, facts: Mapping[str, int]) -> int:
        """The most host syncs the generation may make in all (the exact counts and the bounds)."""
        exact, at_most = self.bounds(facts)
        return sum(exact.values()) + sum(at_most.values())

    def mismatches(self, counts: Counts) -> list[str]:
        """How ``counts`` departs from the rule (empty: it keeps to it)."""
        exact, at_most = self.bounds(counts.facts())
        found = []
        for event in sorted(set(counts.events) | set(exact)):
            n = counts.events.get(event, 0)
            if event in at_most:
                if n > at_most[event]:
                    found.append(f"{event}: {n}, more than {at_most[event]}")
            elif n != exact.get(event, 0):
                found.append(f"{event}: {n}, expected {exact.get(event, 0)}")
        return found

    def rule(self) -> str:
        """The rule in words: "`tolist` 1 per step; `tensor(data)` at most 1 per merged draft + ..."."""
        def terms(parts: Mapping[str, int]) -> str:
            return " + ".join(f"{k} per {_UNITS[fact]}" for fact, k in parts.items())
        return "; ".join([*(f"`{e}` {terms(t)}" for e, t in self.exact.items()),
                          *(f"`{e}` at most {terms(t)}" for e, t in self.at_most.items())])


ONE_READ = {"tolist": {"steps": 1}}
PINNED: dict[str, Pinned] = {
    "baseline": Pinned(lambda v, d: Drafter(v, d), "`Drafter`", "the accepted token", ONE_READ),
    "recycling": Pinned(lambda v, d: TokenRecycling(v, d, tree="paper"), "`TokenRecycling(tree=paper)`",
                        "the accepted path and the bonus token: the matrix, the tree and its update stay on the "
                        "device", ONE_READ),
    "recycling-cold": Pinned(lambda v, d: TokenRecycling(v, d, tree="paper-b4", start="cold"),
                             "`TokenRecycling(tree=paper-b4, start=cold)`", "as hot: the prefill seeds the matrix on "
                             "the device", ONE_READ),
    "eagle-static": Pinned(lambda v, d: Eagle(v, d, head="random", tree="paper-b3"),
                           "`Eagle(head=random, tree=paper-b3)`", "the accepted path; per generation the answer's "
                           "first token for the head's catch-up and its own KV cache's two empty tensors",
                           {"tolist": {"steps": 1}, "tensor(data)": {"generation": 3}}),
    "eagle-dynamic": Pinned(lambda v, d: Eagle(v, d, head="random", tree="dynamic", total_tokens=8, depth=3, top_k=2),
                            "`Eagle(head=random, tree=dynamic, total_tokens=8, depth=3, top_k=2)`",
                            "EAGLE-2 chooses its tree on the host: two reads and a write per step more",
                            {"tolist": {"steps": 3}, "tensor(data)": {"steps": 1, "generation": 3}}),
    "pld": Pinned(lambda v, d: PromptLookup(v, d), "`PromptLookup()`", "the copied chain is a host list: a write "
                  "each time it drafts", {"tolist": {"steps": 1}, "tensor(data)": {"drafting": 1}}),
    "lookahead": Pinned(lambda v, d: Lookahead(v, d), "`Lookahead()`", "the window is a host list: a write every "
                        "step, and a read of its update", {"tolist": {"steps": 2}, "tensor(data)": {"steps": 1}}),
    "sam-switch": Pinned(lambda v, d: SamDecoding(v, d, mode="switch"), "`SamDecoding(mode=switch)`",
                         "a write per retrieved chain (the fallback's tree stays on the device)",
                         {"tolist": {"steps": 1}, "tensor(data)": {"retrieval": 1}}),
    "sam-merge": Pinned(lambda v, d: SamDecoding(v, d, mode="merge"), "`SamDecoding(mode=merge)`",
                        "the trie merge reads the fallback tree's tokens; a write per merged or retrieved draft at "
                        "most (none where the chain adds nothing)", {"tolist": {"steps": 1, "merged": 1}},
                        {"tensor(data)": {"merged": 1, "retrieval": 1}}),
}


def markdown_table() -> str:
    """The rules of :data:`PINNED` as a Markdown table (docs/gpu.md holds it; a test checks it is this one)."""
    rows = ["| method | drafter | host syncs per generation | why |", "| --- | --- | --- | --- |"]
    rows += [f"| {name} | {p.drafter} | {p.rule()} | {p.why} |" for name, p in PINNED.items()]
    return "\n".join(rows)


class Counted:
    """A drafter whose steps, from its ``propose`` to its ``observe`` (the engine's whole step), are counted: by
    ``syncs``, and where ``caught`` collects warnings under ``torch.cuda.set_sync_debug_mode("warn")``, by the
    device's own warnings too."""

    def __init__(self, drafter: Drafter, syncs: HostSyncs, caught: list | None = None):
        self.drafter, self.syncs, self.caught = drafter, syncs, caught
        self.steps = self.drafting = self.device = self._mark = 0

    def __getattr__(self, name: str) -> object:
        return getattr(self.drafter, name)

    def propose(self, ids: list[int]) -> Draft | None:
        self.syncs.counting = True
        self._mark = len(self.caught) if self.caught is not None else 0
        return self.drafter.propose(ids)

    def observe(self, step: Step) -> None:
        self.drafter.observe(step)
        self.syncs.counting = False
        if self.caught is not None:
            self.device += sum(DEVICE_SYNC_WARNING in str(w.message) for w in self.caught[self._mark:])
        self.steps += 1
        self.drafting += step.shape.n_nodes > 1


def count(engine: Engine, drafter: Drafter, prompt: Sequence[int] = PROMPT, tokens: int = 40) -> Counts:
    """Host syncs per step of a second generation (the first builds the shapes a drafter reuses); on CUDA also the
    device's own count of synchronising calls in the same steps."""
    engine.generate(list(prompt), drafter, 8)
    syncs = HostSyncs()
    syncs.counting = False
    cuda = engine.device.type == "cuda"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        counted = Counted(drafter, syncs, caught if cuda else None)
        if cuda:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            with syncs:
                gen = engine.generate(list(prompt), counted, tokens)
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode("default")
    return Counts(events=syncs.events, steps=counted.steps, drafting=counted.drafting,
                  sources=dict(gen.drafter_stats.get("sources", {})), device=counted.device if cuda else None)
