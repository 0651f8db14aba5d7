"""The shared decoding loop and the lossless tree-verification engine.

Every method runs through :meth:`Engine.generate`: prefill, then steps until EOS or
``max_new_tokens``. A step feeds ``[root, draft nodes, extras]`` to the model in one forward with a
tree attention mask and ``position_ids = prefix length + depth``, accepts the longest root-to-leaf
path whose every token equals the choice rule's token at its parent (ties: the first in BFS order),
appends the bonus token (the rule's token after the last accepted node), keeps the accepted nodes' KV
entries in place and drops the rest. With no draft this is plain decoding, one token per forward: the
baseline.

The choice rule (:class:`methods.sampling.Sampling`) is the argmax (greedy decoding, the default), or a
sample whose noise is keyed by the absolute position it predicts, so that every node predicting position t
uses the baseline's noise for t. Either way the output is the baseline's whatever the drafter proposes, up
to floating-point: exact in float32; in half precision a batched forward can flip near-tie choices, which
the analysis stage reports rather than hides.

A forward's time is not monotonic in its token count: a CPU's matrix kernels work in blocks, and on
this project's machines 7 or 11 tokens cost more than 8 or 12 (the device calibration measures it).
Given a :class:`Padding`, the engine feeds a block as the faster larger size, the extra rows being
padding tokens that nothing attends to and whose outputs and KV entries are dropped; drafters never
see them.
"""

from __future__ import annotations

import bisect
import inspect
import time
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Sequence

import torch
from transformers import PreTrainedModel

from methods.drafter import Drafter, Step
from methods.kv import SlabCache
from methods.sampling import Sampling
from methods.tree import Draft, ShapeBuffers, TreeShape, chain


def cache_keyword(forward) -> str:
    """The name a transformers forward takes its KV cache under: ``cache`` (5.x), else ``past_key_values``."""
    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"


@dataclass(frozen=True)
class Padding:
    """The block size to feed ``q`` tokens as, per context bucket (from a device calibration).

    ``sizes[j][q]`` serves contexts below ``bounds[j]`` (the last: the rest); a ``q`` past a table's end
    is fed as it is. A single token is never padded, so the baseline stays plain greedy decoding.
    """

    bounds: tuple[int, ...]
    sizes: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        if len(self.bounds) != len(self.sizes) - 1:
            raise ValueError("a padding needs one bound between every two context buckets")
        for table in self.sizes:
            if any(to < q for q, to in enumerate(table)):
                raise ValueError("padding can only add tokens to a block")
            if len(table) > 1 and table[1] != 1:
                raise ValueError("a single token (the baseline's step) is never padded")

    def table(self, context: int) -> tuple[int, ...]:
        """The sizes serving a context length (its bucket's table)."""
        return self.sizes[bisect.bisect_right(self.bounds, context)]

    def size(self, q: int, context: int) -> int:
        table = self.table(context)
        return table[q] if q < len(table) else q

    def describe(self) -> dict:
        """The sizes that are padded, per bucket: ``{"below": bound, "pad": {"q": size}}`` (JSON keys)."""
        return {"buckets": [{"below": b, "pad": {str(q): to for q, to in enumerate(t) if to != q}}
                            for t, b in zip(self.sizes, [*self.bounds, None])]}


@lru_cache(maxsize=1024)
def padded(shape: TreeShape, extra: int) -> TreeShape:
    """``shape`` with ``extra`` padding tokens after it: extras that see only the prefix and themselves, at the
    root's position, so no draft node or other extra attends to them."""
    return TreeShape(parents=shape.parents, extra_depths=shape.extra_depths + (0,) * extra,
                     extra_visible=shape.extra_visible + ((),) * extra)


def accept(shape: TreeShape, buf: ShapeBuffers, block: torch.Tensor, pred: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """The acceptance rule, on the device: a node is correct when its token is the rule's choice (``pred``) at its
    parent; it is accepted when it and all its ancestors are correct. The deepest accepted node wins, the first in
    BFS order on ties. Returns that node ([1]: a 1-element index reads no host) and the block indices of its path
    ([max depth + 1], padded with the node itself). Shared by the engine's step and the batched one."""
    n1 = shape.n_nodes
    correct = torch.ones(n1, dtype=torch.bool, device=block.device)
    correct[1:] = block[1:n1] == pred[buf.parents]
    accepted = ~(buf.ancestors & ~correct).any(-1)  # [n1]
    best = torch.where(accepted, buf.depths[:n1], -1).argmax().view(1)
    return best, buf.paths.index_select(0, best)[0]


def picked_size(shape: TreeShape) -> int:
    """The values a step reads back per sequence: the accepted node, its path's tokens and the bonus token."""
    return max(shape.depth_list[: shape.n_nodes]) + 3


def read_path(shape: TreeShape, buf: ShapeBuffers, picked: list[int]) -> tuple[int, torch.Tensor, list[int], list[int]]:
    """What the host read of a step (``[best, path tokens, bonus]``, :func:`picked_size` values) says: the accepted
    node, its path's block indices on the device ([L], root first), the sibling ranks of the accepted draft nodes,
    and the tokens emitted (the accepted nodes' and the bonus: L of them)."""
    best = picked[0]
    length = shape.depth_list[best] + 1  # root + accepted nodes
    ranks = [shape.sibling_ranks[i] for i in shape.paths[best][1:]]
    return best, buf.paths[best, :length], ranks, picked[2 : 1 + length] + [picked[-1]]


class PromptTooLong(ValueError):
    """The prompt alone fills the model's context: no room for an answer."""


@dataclass
class Generation:
    """The outcome of one generation (one turn)."""

    output_ids: list[int]  # new tokens, EOS included when generated
    accept_lengths: list[int] = field(default_factory=list)  # tokens emitted per decode forward (bonus included)
    accept_paths: list[list[int]] = field(default_factory=list)  # per step: sibling ranks of the accepted drafts
    block_sizes: list[int] = field(default_factory=list)  # per step: tokens fed to the forward (root included)
    prefill_time: float = 0.0  # seconds: prefill forward and first token
    decode_time: float = 0.0  # seconds: all decode steps
    forward_time: float | None = None  # seconds of decode_time inside the model forward (when timed)
    drafter_stats: dict = field(default_factory=dict)  # Drafter.finish(): the drafter's own counters
    end: str = ""  # why the answer ended: "stop" (a stop token), "budget" (max_new_tokens) or "context" (the model's)
    # batched (methods.batch): the row it was decoded in, and its batch engine's clock (seconds of the engine's own
    # work) at its prefill's start and at its last token; None from Engine.generate
    slot: int | None = None
    started: float | None = None
    finished: float | None = None

    @property
    def wall_time(self) -> float:
        return self.prefill_time + self.decode_time

    @property
    def decoding_steps(self) -> int:
        return len(self.accept_lengths)


class Engine:
    """Verifies draft trees against a Hugging Face causal LM (batch size 1) under one choice rule."""

    def __init__(self, model: PreTrainedModel, eos_token_ids: set[int], max_length: int | None = None,
                 time_forward: bool = False, padding: Padding | None = None, sampling: Sampling | None = None):
        """``time_forward`` times every decode forward apart (on CUDA at the price of two syncs per step),
        so that the engine's and the drafter's own time per step can be reported. ``padding``: feed each
        block as the size it names. ``sampling``: the choice rule (None: greedy decoding)."""
        self.model = model
        self.sampling = sampling or Sampling()
        self._key = 0  # the generation's key: with the sampling seed and a position it keys the noise
        self.padding = padding
        self.time_forward = time_forward
        self.forward_time = 0.0
        self.eos = frozenset(eos_token_ids)
        config = model.config.get_text_config()
        self.max_length = max_length or getattr(config, "max_position_embeddings", None)
        self.device = model.device
        self.dtype = model.dtype
        self._min = torch.finfo(self.dtype).min
        self.cache_kw = cache_keyword(model.forward)
        layer_types = set(getattr(config, "layer_types", None) or ["full_attention"])
        unknown = layer_types - {"full_attention", "sliding_attention"}
        if unknown:
            raise NotImplementedError(f"draftbench's tree masks support full and sliding attention, not {sorted(unknown)}")
        # Sliding-window layers get their own windowed mask; every layer's cache keeps the whole
        # prefix (methods.kv), so accepted entries can always be gathered into place.
        self.window = config.sliding_window if "sliding_attention" in layer_types else None
        self._mask = torch.zeros(0, 0, dtype=self.dtype, device=self.device)  # zero outside the live block
        self._root = torch.zeros(1, dtype=torch.long, device=self.device)  # the next step's root token
        self.layers = config.num_hidden_layers
        self._cache: SlabCache | None = None  # reused from one generation to the next
        self._pad = torch.zeros(max(map(max, padding.sizes)) if padding else 0,
                                dtype=torch.long, device=self.device)  # padding tokens' ids (any will do)

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def new_cache(self, capacity: int = 0) -> SlabCache:
        """An empty KV cache for this model, with room for ``capacity`` positions to begin with."""
        return SlabCache(self.layers, capacity)

    @torch.inference_mode()
    def generate(self, prompt_ids: list[int], drafter: Drafter, max_new_tokens: int, key: int = 0) -> Generation:
        """Decode up to ``max_new_tokens`` after ``prompt_ids`` by the choice rule, verifying ``drafter``'s drafts.
        ``key`` (any int) keys the sampling noise with the seed: the same key, the same answer.

        The answer ends at the first stop token, at ``max_new_tokens``, or where prompt + answer fill the model's
        context (``max_length``), by the same rule for every method; :attr:`Generation.end` says which.
        """
        if max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be positive, got {max_new_tokens}")
        if self.max_length is not None and len(prompt_ids) >= self.max_length:
            raise PromptTooLong(f"a prompt of {len(prompt_ids)} tokens leaves no room for an answer within the "
                                f"model's context of {self.max_length} tokens")
        limit = len(prompt_ids) + max_new_tokens if self.max_length is None else min(
            len(prompt_ids) + max_new_tokens, self.max_length)  # the longest prompt + answer
        drafter.attach(self.model)
        drafter.begin(self.sampling, key)
        self._key = key
        if self._cache is None:
            self._cache = self.new_cache(limit + 64)
        cache = self._cache
        cache.commit(0)
        prompt = torch.tensor(prompt_ids, dtype=torch.long, device=self.device)
        self.sync()
        start = time.perf_counter()
        layers = drafter.hidden_layers
        out = self.model(
            input_ids=prompt[None],
            use_cache=True,
            logits_to_keep=0 if drafter.needs_prefill_logits else 1,
            output_hidden_states=list(layers) if layers else False,
            **{self.cache_kw: cache},
        )
        cache.commit(len(prompt_ids))
        logits = out.logits[0]
        first = int(self.sampling.choose(logits[-1:], key, len(prompt_ids)))  # the prefill's one host sync
        self._root.fill_(first)
        drafter.reset(prompt, logits if drafter.needs_prefill_logits else None, self._hidden(out, layers))
        self.sync()
        gen = Generation(output_ids=[first])
        gen.prefill_time = time.perf_counter() - start

        ids = list(prompt_ids) + [first]
        self.forward_time = 0.0
        start = mark = time.perf_counter()
        while ids[-1] not in self.eos and len(ids) < limit:
            draft = drafter.propose(ids)
            step = self.verify(None, len(ids) - 1, draft, cache, layers)
            step.emitted = self._stop(step.emitted, limit - len(ids))
            now = time.perf_counter()
            step.seconds, mark = now - mark, now
            emitted = step.emitted
            gen.output_ids += emitted
            gen.accept_lengths.append(len(emitted))
            gen.accept_paths.append(step.path_ranks[: len(emitted)])  # a budget cut may drop the bonus first
            gen.block_sizes.append(step.fed)
            ids += emitted
            drafter.observe(step)
        self.sync()
        gen.decode_time = time.perf_counter() - start
        gen.forward_time = self.forward_time if self.time_forward else None
        gen.end = "stop" if ids[-1] in self.eos else "budget" if len(gen.output_ids) >= max_new_tokens else "context"
        gen.drafter_stats = drafter.finish()
        return gen

    def fed_size(self, size: int, position: int) -> int:
        """The tokens a block of ``size`` is fed as at ``position`` (its padding's size, or itself)."""
        return size if self.padding is None else self.padding.size(size, position)

    def _stop(self, emitted: list[int], room: int) -> list[int]:
        """Cut a step's tokens after the first EOS and at the token budget, exactly as the baseline."""
        emitted = emitted[:room]
        for i, token in enumerate(emitted):
            if token in self.eos:
                return emitted[: i + 1]
        return emitted

    def verify(self, root: int | None, position: int, draft: Draft | None, cache: SlabCache,
               hidden_layers: Sequence[int] = ()) -> Step:
        """One step: verify ``draft`` after ``root`` (at ``position``) in one forward and keep the accepted KV;
        ``root=None``: the token the previous step ended with, already on the device (no host write);
        ``hidden_layers``: the hidden states to hand over in the step (:attr:`Drafter.hidden_layers`).

        Everything stays on the device until the one host read of the step: the accepted path and the bonus token.
        """
        shape: TreeShape = draft.shape if draft is not None else chain(0)
        buf = shape.buffers(self.device, self.dtype)
        if root is not None:
            self._root.fill_(root)
        block = self._root.clone() if draft is None else torch.cat([self._root, draft.tokens])  # [size]
        size = shape.size
        fed, fed_block = shape, block
        extra = self.fed_size(size, position) - size
        if extra:
            fed, fed_block = padded(shape, extra), torch.cat([block, self._pad[:extra]])
        fed_buf = fed.buffers(self.device, self.dtype)
        positions = fed_buf.depths + position
        if self.max_length is not None and position + fed.size > self.max_length:
            # nodes past the context are never emitted (the answer ends there); keeping their positions inside it
            # keeps every position-dependent computation (e.g. dynamic RoPE scaling) as in plain decoding
            positions = positions.clamp(max=self.max_length - 1)
        if self.time_forward:
            self.sync()
            start = time.perf_counter()
        out = self.model(
            input_ids=fed_block[None],
            position_ids=positions[None],
            attention_mask=None if fed.is_chain else self._attention_mask(fed, fed_buf.mask_block, position),
            use_cache=True,
            output_hidden_states=list(hidden_layers) if hidden_layers else False,
            **{self.cache_kw: cache},
        )
        if self.time_forward:
            self.sync()
            self.forward_time += time.perf_counter() - start
        if not fed.is_chain:
            self._mask[: fed.size, position : position + fed.size].zero_()  # restore the all-zero invariant
        logits = out.logits[0, :size]  # [size, V]: padding rows dropped
        # the rule's token after every block token: row i predicts position + depth_i + 1
        pred = self.sampling.choose(logits, self._key, position + 1, buf.depths, max(shape.depth_list) + 1)  # [size]

        best, path_ids = accept(shape, buf, block, pred)
        self._root.copy_(pred.index_select(0, best))  # the bonus token: the next step's root, on the device
        picked = torch.cat([best, block.index_select(0, path_ids), self._root]).tolist()  # the one host sync
        best_i, path, ranks, emitted = read_path(shape, buf, picked)
        length = len(emitted)  # root + accepted nodes
        if shape.paths[best_i][-1] == length - 1:  # the accepted nodes already follow the root
            cache.commit(position + length)
        else:
            cache.keep(position, path)
        return Step(
            position=position,
            shape=shape,
            tokens=block,
            logits=logits,
            predictions=pred,
            accepted=path,
            path_ranks=ranks,
            emitted=emitted,
            hidden_states=self._hidden(out, hidden_layers, size),
            fed=fed.size,
        )

    @staticmethod
    def _hidden(out: object, layers: Sequence[int], size: int | None = None) -> torch.Tensor | None:
        """The requested layers' hidden states of the one sequence (its first ``size`` tokens), concatenated:
        [tokens, len(layers) x hidden]."""
        if not layers:
            return None
        states = [out.hidden_states[i][0, :size] for i in layers]
        return states[0] if len(states) == 1 else torch.cat(states, -1)

    def _attention_mask(self, shape: TreeShape, block_mask: torch.Tensor, position: int) -> torch.Tensor | dict:
        """Additive float mask [1, 1, size, position + size]: the prefix is visible, the block is the tree's."""
        size = shape.size
        width = position + size
        if self._mask.shape[0] < size or self._mask.shape[1] < width:
            rows, cols = max(size, self._mask.shape[0]), max(2 * width, self._mask.shape[1])
            self._mask = torch.zeros(rows, cols, dtype=self.dtype, device=self.device)
        self._mask[:size, position:width] = block_mask
        mask = self._mask[None, None, :size, :width]
        if self.window is None:
            return mask
        return {"full_attention": mask, "sliding_attention": self._sliding(mask, shape, position)}

    def _sliding(self, mask: torch.Tensor, shape: TreeShape, position: int) -> torch.Tensor:
        """Block keys that fall outside each query's window (query position - key position >= window)."""
        depths = shape.buffers(self.device, self.dtype).depths
        if position + max(shape.depth_list) < self.window:
            return mask
        keys = torch.arange(mask.shape[-1], device=self.device)
        outside = keys[None, :] <= (position + depths)[:, None] - self.window  # block keys sit inside the window
        return mask.masked_fill(outside[None, None], self._min)
