"""The cost of a verification step on this machine, with its uncertainty: what plans are chosen with.

A device calibration times a step over ``q`` tokens at a few context lengths, several times each. Planning on the
means alone chases noise: a size that happened to measure 10% fast becomes the padding target and decides the
tree, and the plan then predicts the luck (the winner's curse). So a :class:`CostCurve` keeps, besides the fitted
times, ``B`` bootstrap replicates of the whole fitted curve (every point's repeats resampled, then fitted the same
way). Any quantity derived from the curve (a tree's tokens per second, a padding's gain, a speedup) has a
replicate per curve, and a choice wins only where it wins in most replicates: :func:`beats`.

The fit: per ``q``, the times are smoothed over the context (a least-squares quadratic in the context length, a
line for three contexts or fewer: a step reads the whole prefix, so its time grows about linearly) and made
non-decreasing in the context (isotonic regression). Along ``q`` the times stay as measured: a ``q`` that fills
the matrix kernels' blocks can cost less than a smaller one, and that is real; whether it is real enough to pad
to is decided against the replicates.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from functools import cached_property
from typing import Callable, Mapping, Protocol, Sequence

import numpy as np

PAD_GAIN = 0.05  # a block is padded only to a size at least this much faster (smaller gains are not worth chasing)
CONFIDENCE = 0.95  # a choice beats another where it wins in this share of the replicates
REPLICATES = 200


def smoother(xs: Sequence[float]) -> np.ndarray:
    """The hat matrix of the least-squares polynomial in ``xs`` (quadratic from four points on, linear from two,
    the identity for one): ``smoother(xs) @ ys`` are the fitted values."""
    n = len(xs)
    degree = 2 if n >= 4 else min(1, n - 1)
    if not degree:
        return np.eye(n)
    x = np.asarray(xs, dtype=float) / max(xs)  # keeps the fit well conditioned
    design = np.vander(x, degree + 1)
    return design @ np.linalg.pinv(design)


def isotonic(values: np.ndarray) -> np.ndarray:
    """The least-squares non-decreasing fit along the last axis (pool adjacent violators), for every row."""
    values = np.asarray(values, dtype=float)
    out = np.empty_like(values)
    for index in np.ndindex(values.shape[:-1]):
        blocks: list[list[float]] = []  # [mean, count]
        for v in values[index]:
            blocks.append([float(v), 1])
            while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
                (m2, n2), (m1, n1) = blocks.pop(), blocks.pop()
                blocks.append([(m1 * n1 + m2 * n2) / (n1 + n2), n1 + n2])
        out[index] = [m for m, n in blocks for _ in range(int(n))]
    return out


def interp(x: float, xs: Sequence[float], ys: np.ndarray) -> np.ndarray:
    """``ys[..., i]`` at ``xs[i]``, interpolated at ``x`` along the last axis: piecewise linear, linearly
    extrapolated from the last two points past either end."""
    if len(xs) == 1:
        return ys[..., 0] * (x / xs[0] if xs[0] else 1.0)
    j = min(max(bisect.bisect_right(xs, x) - 1, 0), len(xs) - 2)
    w = (x - xs[j]) / (xs[j + 1] - xs[j])
    return ys[..., j] * (1 - w) + ys[..., j + 1] * w


@dataclass(frozen=True, eq=False)
class CostCurve:
    """Step times (ms) by context length and block size: fitted, and ``B`` bootstrap replicates of the fit."""

    contexts: tuple[int, ...]
    sizes: tuple[int, ...]
    fitted: np.ndarray  # [contexts, sizes]
    replicates: np.ndarray  # [B, contexts, sizes]
    _cache: dict = field(default_factory=dict, repr=False, compare=False)  # (q, context) -> replicates, once each

    @classmethod
    def from_samples(cls, contexts: Sequence[int], sizes: Sequence[int], samples: Sequence[Sequence[Sequence[float]]],
                     replicates: int = REPLICATES, seed: int = 0) -> CostCurve:
        """From every point's repeated times (``samples[context][size]``, ms; at least one each). A point is the
        *mean* of its repeats: a run's speed is its steps' mean time, and a step's time has a right tail (the
        median of the same repeats was a few percent faster than the runs here)."""
        rng = np.random.default_rng(seed)
        means = np.array([[np.mean(point) for point in row] for row in samples])  # [C, S]
        boot = np.empty((replicates, *means.shape))
        for c, row in enumerate(samples):
            for s, point in enumerate(row):
                point = np.asarray(point, dtype=float)
                boot[:, c, s] = np.mean(point[rng.integers(0, len(point), (replicates, len(point)))], axis=1)
        return cls(tuple(contexts), tuple(sizes), cls._fit(contexts, means), cls._fit(contexts, boot))

    @staticmethod
    def _fit(contexts: Sequence[int], points: np.ndarray) -> np.ndarray:
        """Smoothed over the context per size, then non-decreasing in the context (axis -2)."""
        smoothed = np.einsum("ij,...jk->...ik", smoother(contexts), points)
        return np.swapaxes(isotonic(np.swapaxes(smoothed, -1, -2)), -1, -2)

    def _at(self, table: np.ndarray, q: float, context: float) -> np.ndarray:
        per_context = interp(q, self.sizes, table)  # [..., C]
        return np.maximum(interp(context, self.contexts, per_context), 1e-3) / 1000

    def seconds(self, q: float, context: float) -> float:
        """The fitted time of a step over ``q`` tokens at a context length (s): piecewise linear in both."""
        return float(self._at(self.fitted, q, context))

    def replicate_seconds(self, q: float, context: float) -> np.ndarray:
        """The same from every bootstrap replicate ([B] s); computed once per (q, context): a plan that corrects
        itself while a run goes asks for the same ones again and again."""
        key = (q, context)
        if key not in self._cache:
            self._cache[key] = self._at(self.replicates, q, context)
        return self._cache[key]

    def interval(self, q: float, context: float, level: float = 0.9) -> tuple[float, float]:
        """The central ``level`` interval of a step's time (s) over the replicates."""
        reps = self.replicate_seconds(q, context)
        return tuple(float(v) for v in np.quantile(reps, [(1 - level) / 2, (1 + level) / 2]))

    @cached_property
    def precision(self) -> np.ndarray:
        """Per measured point, half the 90% interval relative to the fitted time ([contexts, sizes])."""
        low, high = np.quantile(self.replicates, [0.05, 0.95], axis=0)
        return (high - low) / 2 / self.fitted

    def pad_table(self, context: float, confidence: float = CONFIDENCE) -> tuple[int, ...]:
        """At a context: ``table[q]``, the measured size >= q to feed ``q`` tokens as. A larger size is chosen when
        its fitted time is at least ``PAD_GAIN`` below q's *and* it is faster in ``confidence`` of the replicates
        (one lucky point is not enough; 0 trusts the means alone); the fastest such size, the smaller on a tie. A
        single token is never padded."""
        table = [0, 1]
        own = {s: (self.seconds(s, context), self.replicate_seconds(s, context)) for s in self.sizes}
        for q in range(2, max(self.sizes) + 1):
            mine, mine_b = self.seconds(q, context), self.replicate_seconds(q, context)
            faster = [(t, s) for s, (t, b) in own.items()
                      if s > q and t <= mine * (1 - PAD_GAIN) and beats(mine_b, b, confidence)]
            table.append(min(faster)[1] if faster else q)
        return tuple(table)

    def at(self, context: float, pad: Sequence[int] | None = None,
           correction: Correction | None = None) -> ContextCost:
        """The step cost at one context length, with blocks fed as ``pad`` says (None: as they are), corrected per
        fed size by a run's own steps (``correction``)."""
        return ContextCost(self, context, tuple(pad) if pad is not None else None, correction)

    def describe(self) -> dict:
        """The precision of the calibration in a few numbers (for its summary line and the report)."""
        p = self.precision
        return {"median_half_interval": round(float(np.median(p)), 4), "widest_half_interval": round(float(p.max()), 4),
                "widest_at": {"context": self.contexts[int(np.argmax(p.max(axis=1)))],
                              "q": self.sizes[int(np.argmax(p.max(axis=0)))]}}


class Correction(Protocol):
    """A run's own evidence on the calibrated step times (:class:`methods.online.CostCorrection`)."""

    def factor(self, fed: int) -> float:
        """The factor on a fed size's calibrated time."""

    def shrink(self, fed: int, spread: float) -> float:
        """The share (0-1) of the calibration's uncertainty at a fed size (``spread``: the standard deviation of its
        log time over the replicates) that is left once the run's own steps at that size are counted."""


@dataclass(frozen=True, eq=False)
class ContextCost:
    """A step's cost at one context length (what one plan bucket is chosen with), optionally corrected per fed
    size by the run's own steps (``correction``, :mod:`methods.online`): the time by its factor, and the
    replicates drawn in towards it as far as the run has timed that size (a gain the run keeps measuring is no
    longer lost in the calibration's noise)."""

    curve: CostCurve
    context: float
    pad: tuple[int, ...] | None = None
    correction: Correction | None = None

    def fed(self, q: int) -> int:
        return self.pad[q] if self.pad is not None and q < len(self.pad) else q

    def seconds(self, q: int) -> float:
        fed = self.fed(q)
        return self.curve.seconds(fed, self.context) * (self.correction.factor(fed) if self.correction else 1.0)

    def replicates(self, q: int) -> np.ndarray:
        fed = self.fed(q)
        reps = self.curve.replicate_seconds(fed, self.context)
        if self.correction is None:
            return reps
        fitted = self.curve.seconds(fed, self.context)
        deviation = np.log(reps / fitted)
        shrink = self.correction.shrink(fed, float(np.std(deviation)))
        return fitted * self.correction.factor(fed) * np.exp(shrink * deviation)

    def __call__(self, q: int) -> float:
        return self.seconds(q)


def beats(slow: np.ndarray, fast: np.ndarray, confidence: float = CONFIDENCE) -> bool:
    """Whether ``fast`` is below ``slow`` in at least ``confidence`` of the paired replicates."""
    return bool(np.mean(np.asarray(fast) < np.asarray(slow)) >= confidence)


def exact(seconds: Callable[[int], float]) -> Callable[[int], np.ndarray]:
    """Replicates for a cost known exactly (a model in a test, a synthetic curve): the value itself."""
    return lambda q: np.array([seconds(q)])


def bounds(contexts: Sequence[int]) -> tuple[int, ...]:
    """Context buckets around calibrated contexts: each ends halfway (geometrically) to the next."""
    return tuple(math.isqrt(a * b) for a, b in zip(contexts, contexts[1:]))


def crossover(speedups: Mapping[int, float]) -> tuple[int | None, int | None]:
    """From a method's speedups over the baseline at the same batch size, by batch size: the largest batch size up to
    which it pays at every one (>= 1.0), and the first at which it loses (< 1.0); None where there is none. The
    batch size above which speculation stops paying is the first value (where the second is not None)."""
    last = None
    for batch in sorted(speedups):
        if speedups[batch] < 1.0:
            return last, batch
        last = batch
    return last, None


def describe_crossover(speedups: Mapping[int, float]) -> str:
    """:func:`crossover` in words."""
    pays, loses = crossover(speedups)
    if loses is None:
        return f"pays at every batch size up to {pays}"
    return f"loses already at batch size {loses}" if pays is None else f"pays up to batch size {pays}, loses from {loses}"
