"""The one choice rule of the baseline and every method: greedy decoding, or sampling with public noise.

At temperature 0 the rule is ``logits.argmax(-1)``: greedy decoding, as it always was. At a temperature T > 0
the token at absolute position t is ``argmax_v (logits[v] / T + G(seed, key, t, v))`` over the tokens that top-k
and top-p keep, where G is Gumbel(0, 1) noise from a counter-based hash of (seed, generation key, t, v): by the
Gumbel-max trick an exact sample from the tempered, truncated distribution. The noise is public and keyed by
position, not drawn from a stream, so a one-token baseline step and any node of any draft tree that predicts
position t see the same noise; a draft node is accepted iff its token equals this rule's choice at its parent,
so the output for a given seed is the baseline's token for token, whatever was drafted (drafter-invariant
speculative decoding, Daliri, Musco and Suresh, arXiv 2408.07978). See docs/sampling.md.

Truncation follows transformers' warpers (temperature, then top-k, then top-p), with ties kept whole: top-k
keeps every token whose logit reaches the k-th largest; top-p keeps every token whose more probable tokens
together hold less than ``top_p`` of the tempered (top-k) distribution.

The noise: a 32-bit hash (Wellons' lowbias32) in int64 torch ops on the logits' device, no host sync. The
seed and key are mixed on the host (Python ints) into two words, every position t gets a 32-bit state from
them, and the noise of (t, v) is the hash of that state xor the hash of v; its 32 bits give u in (0, 1) and
G = -log(-log u), computed as -log(-log1p(-(1 - u))) so that the upper tail, where the maximum is, keeps full
precision. A step computes one V-vector per distinct depth of its block and indexes it to the rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Mapping

import torch

_MASK = 0xFFFFFFFF
_MASK64 = 0xFFFFFFFFFFFFFFFF


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """Wellons' lowbias32 (multipliers 0x21f0aaad, 0x735a2d97) on int64 tensors of 32-bit values. Both
    multipliers are below 2**31, so no product overflows int64: the same bits on every device."""
    x = x ^ (x >> 16)
    x = (x * 0x21F0AAAD) & _MASK
    x = x ^ (x >> 15)
    x = (x * 0x735A2D97) & _MASK
    return x ^ (x >> 15)


def _splitmix64(z: int) -> int:
    """A 64-bit mix of a Python int (host side: the seed and the generation key)."""
    z = (z + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


@lru_cache(maxsize=16)
def _column_hashes(vocab: int, device: torch.device) -> torch.Tensor:
    """The hash of every vocabulary index, once per vocabulary size and device."""
    return _hash32(torch.arange(vocab, device=device))


@dataclass(frozen=True)
class Sampling:
    """The choice rule's settings: ``temperature`` 0 is greedy decoding (the others are then ignored); ``top_k``
    0 and ``top_p`` 1 keep every token; ``seed`` keys the noise with each generation's key."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not (isinstance(self.temperature, (int, float)) and 0 <= self.temperature < float("inf")):
            raise ValueError(f"sampling.temperature must be a number >= 0 (0: greedy decoding), "
                             f"got {self.temperature!r}")
        if not (isinstance(self.top_k, int) and self.top_k >= 0):
            raise ValueError(f"sampling.top_k must be an integer >= 0 (0: no top-k), got {self.top_k!r}")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise ValueError(f"sampling.top_p must be in (0, 1] (1: no top-p), got {self.top_p!r}")
        if not isinstance(self.seed, int):
            raise ValueError(f"sampling.seed must be an integer, got {self.seed!r}")
        object.__setattr__(self, "temperature", float(self.temperature))  # 1 and 1.0 alike in every key
        object.__setattr__(self, "top_p", float(self.top_p))

    @classmethod
    def of(cls, settings: Mapping | None) -> Sampling:
        """From a mapping of the settings (the harness's ``sampling`` config group); None: greedy decoding."""
        return cls(**dict(settings or {}))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def tag(self) -> str:
        """What names a sampled run (its label and result file): ``T0.7-k50-p0.9-s1``, non-default parts only;
        "" for greedy decoding."""
        if self.greedy:
            return ""
        parts = [f"T{self.temperature:g}", f"k{self.top_k}" if self.top_k else "",
                 f"p{self.top_p:g}" if self.top_p < 1 else "", f"s{self.seed}" if self.seed else ""]
        return "-".join(p for p in parts if p)

    def noise(self, key: int, start: int, span: int, vocab: int, device: torch.device | str,
              columns: torch.Tensor | None = None) -> torch.Tensor:
        """Gumbel(0, 1) noise [span, vocab] of positions ``start .. start + span - 1`` for a generation's ``key``;
        ``columns`` (token ids on ``device``): only those columns, [span, len(columns)], the same values."""
        device = torch.device(device)
        words = _splitmix64(_splitmix64(self.seed) ^ (key & _MASK64))
        low, high = words & _MASK, words >> 32
        positions = torch.arange(start, start + span, device=device) & _MASK
        state = _hash32(_hash32(positions ^ low) ^ high)  # [span]
        hashes = _column_hashes(vocab, device)
        if columns is not None:
            hashes = hashes.index_select(0, columns)
        bits = _hash32(state[:, None] ^ hashes[None, :])  # [span, columns]
        w = bits.float().add_(0.5).mul_(2.0 ** -32)  # 1 - u, in (0, 1)
        w.clamp_(max=1 - 2.0 ** -24)  # float32 rounds the largest few to 1: keep -log u finite
        return w.neg_().log1p_().neg_().log_().neg_()  # -log(-log u), u = 1 - w

    def choose(self, logits: torch.Tensor, key: int, start: int, offsets: torch.Tensor | None = None,
               span: int = 1) -> torch.Tensor:
        """The rule's token [n] for every row of ``logits`` [n, V]: row i predicts position ``start + offsets[i]``
        (``offsets`` [n] long on the device, below ``span``; None: every row at ``start``)."""
        if self.greedy:
            return logits.argmax(-1)
        noise = self.noise(key, start, span, logits.shape[-1], logits.device).mul_(self.temperature)
        # argmax(logits / T + G) = argmax(logits + T G): one [n, V] pass fewer
        if offsets is None:
            scores = logits.float() + noise
        else:
            scores = noise.index_select(0, offsets).add_(logits)
        return self.select(logits, scores)

    def select(self, logits: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """The argmax [n] of ``scores`` = logits + T * noise [n, V] (overwritten) over the tokens top-k and top-p
        keep of ``logits``. For drafters that draw with the target's noise (EAGLE's ``draft=coupled``)."""
        kth = None
        if 0 < self.top_k < logits.shape[-1]:
            kth = logits.topk(self.top_k, -1).values[:, -1:]
            scores.masked_fill_(logits < kth, float("-inf"))
        if self.top_p >= 1:
            return scores.argmax(-1)
        # two exact ways to the same nucleus: a CPU sorts a row of 49k logits in milliseconds but reads for free; a
        # GPU sorts every row at once but would stall on a read
        nucleus = self._nucleus_by_check if logits.device.type == "cpu" else self._nucleus_by_sort
        return nucleus(logits, scores, kth)

    def _nucleus_by_sort(self, logits: torch.Tensor, scores: torch.Tensor, kth: torch.Tensor | None) -> torch.Tensor:
        """Top-p by sorting every row's (top-k) logits: no host read."""
        values = logits.float() if kth is None else logits.float().masked_fill(logits < kth, float("-inf"))
        floor = self._floor(values.sort(-1, descending=True).values, values.max(-1, keepdim=True).values, None)
        return scores.masked_fill_(logits < floor, float("-inf")).argmax(-1)

    def _floor(self, ordered: torch.Tensor, top: torch.Tensor, mass: torch.Tensor | None) -> torch.Tensor:
        """The lowest logit inside the nucleus [n, 1], from each row's logits in descending order [n, K]: the last
        one whose more probable tokens hold less than top_p of the row's mass (``mass``: its sum of
        exp((logit - top) / T) over all kept tokens; None: ``ordered`` holds them all)."""
        e = ((ordered - top) / self.temperature).exp()
        total = e.sum(-1, keepdim=True) if mass is None else mass
        before = e.cumsum(-1) - e  # the mass of the tokens ranked above each
        last = (before < self.top_p * total).sum(-1, keepdim=True) - 1
        return ordered.gather(-1, last)

    def _nucleus_by_check(self, logits: torch.Tensor, scores: torch.Tensor, kth: torch.Tensor | None) -> torch.Tensor:
        """Top-p without a sort per row: the candidate, the argmax over all kept tokens, is inside the nucleus iff
        the tokens more probable than it hold less than top_p, and then it is the answer; only the rows where it
        is not rank their tokens above it (``topk``). One host read: which rows, and how many tokens above."""
        choice = scores.argmax(-1, keepdim=True)  # [n, 1]
        own = logits.gather(-1, choice)
        top = logits.max(-1, keepdim=True).values
        e = torch.sub(logits.float(), top).div_(self.temperature).exp_()
        if kth is not None:
            e.masked_fill_(logits < kth, 0)
        mass = e.sum(-1, keepdim=True)
        above = logits > own
        outside = torch.where(above, e, 0).sum(-1, keepdim=True) >= self.top_p * mass
        counts = torch.where(outside, above.sum(-1, keepdim=True), 0)[:, 0].tolist()
        rows = [i for i, c in enumerate(counts) if c]
        choice = choice[:, 0]
        if not rows:
            return choice
        index = torch.tensor(rows, device=logits.device)
        ordered, tokens = logits.index_select(0, index).float().topk(max(counts), -1)  # the nucleus is among them
        floor = self._floor(ordered, top.index_select(0, index).float(), mass.index_select(0, index))
        inside = scores.index_select(0, index).gather(-1, tokens).masked_fill_(ordered < floor, float("-inf"))
        return choice.index_copy(0, index, tokens.gather(-1, inside.argmax(-1, keepdim=True))[:, 0])
