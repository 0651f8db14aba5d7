"""Batched speculative decoding: B sequences decoded at once, every row's draft verified in one forward.

:class:`BatchEngine` serves *sessions*: generators that yield a :class:`Request` (a prompt, a token budget, a sampling
key) and receive its :class:`~methods.engine.Generation`, one per turn, so the engine knows nothing of questions or
turns (turn 2's prompt holds turn 1's answer because its session builds it). A row whose turn ends hands the
generation back and prefills its session's next request; a session that ends frees its row for the next session
(continuous batching: a batch is never held back by its longest answer).

**KV layout** (:class:`~methods.kv.BatchCache`): one slab for every layer and row, each row's valid entries
left-aligned at ``[0, L_b)``. A step feeds every row's block at the same columns ``[C, C + q)``, ``C = max L_b``:
row b sees its prefix ``[0, L_b)`` and its own tree in the block, and its hole ``[L_b, C)`` is masked (an additive
float mask ``[rows, 1, q, C + q]`` built on the device from the rows' lengths). Positions are per row, ``L_b +
depth``. After acceptance, every row's accepted entries move from ``C + path_b`` to ``[L_b, L_b + len_b)`` in one
gather and one scatter for all rows and layers. Left-aligned rows keep every row's prefix contiguous, so that a
row is prefilled alone, in place, exactly as at batch size 1, and a hole never outlives a step.

**Blocks** of different trees are padded to the batch's largest (then to the engine's :class:`~methods.engine.Padding`
of that size) with padding tokens that see only the prefix and themselves and that nothing attends to, as the
engine pads a single block; a forward covers the rows up to the last busy one (an idle row inside is all padding).

**Prefill**: a new row is prefilled alone (a batch-1 forward into its row of the slab) when it starts, so its
prompt's KV entries and first token are batch 1's; rows start at different steps anyway.

**Verification** is :func:`methods.engine.accept` per row on the device, and the step has one host read for the
whole batch: every row's accepted path and bonus token in one ``.tolist()``.

**Drafters**: each row has its own (:meth:`~methods.drafter.Drafter.fork` of the one given), sharing what
:meth:`~methods.drafter.Drafter.shared` names. Every row proposes before the forward; after it, rows observe in slot
order, so hot-start state shared by the rows (Token Recycling's matrix) is updated in that order.

**Sampling**: each row keeps its request's key, so a row's noise is its question's and turn's, as at batch size 1:
every row's output equals its request's output at batch size 1, whatever the other rows hold (exact in float32 up
to the matrix kernels' rounding for other row counts; evaluation.equal reports any difference).

**Clock**: the engine counts the seconds of its own work (prefills and steps, not its sessions' code): a
generation's times and ``started``/``finished`` are on that clock, so that several engines run step by step in turn
(``evaluation.interleave``) each time only their own work.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Generator, Iterable, Iterator, Sequence

import torch

from methods.drafter import Drafter, Step
from methods.engine import Engine, Generation, PromptTooLong, accept, padded, picked_size, read_path
from methods.kv import BatchCache
from methods.tree import Draft, chain


@dataclass(frozen=True)
class Request:
    """One generation a session asks for: as :meth:`Engine.generate`'s arguments."""

    prompt_ids: list[int]
    max_new_tokens: int
    key: int = 0


Session = Generator[Request, Generation, object]


class BatchUnsupported(NotImplementedError):
    """What the batched engine cannot serve yet; the message says what and what to do."""


@dataclass
class _Row:
    """A busy row: its session, its drafter and the generation in flight."""

    session: Session
    drafter: Drafter
    ids: list[int]  # prompt + output so far
    limit: int  # the longest prompt + answer
    max_new_tokens: int
    gen: Generation
    decoding: float  # the engine's clock when its decoding began (after its prefill)
    forward: float = 0.0  # seconds of its steps inside the model forward (when timed)
    error: BaseException | None = None  # a failure of this row alone (its drafter), handed to its session

    @property
    def done(self) -> bool:
        return self.error is not None or self.gen.end != ""


class BatchEngine:
    """Serves sessions ``batch_size`` at a time over an :class:`Engine`'s model, choice rule, padding and stop tokens."""

    def __init__(self, engine: Engine, batch_size: int):
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        if engine.window is not None:
            raise BatchUnsupported(
                f"batch_size={batch_size}: the batched engine does not support sliding-window attention layers "
                f"({type(engine.model).__name__}, e.g. Gemma-3) yet; run this model with batch_size=1")
        self.engine, self.batch_size = engine, batch_size
        device = engine.device
        self.cache = BatchCache(engine.layers, batch_size)
        self.lengths = [0] * batch_size  # every row's valid prefix (host)
        self._lengths = torch.zeros(batch_size, dtype=torch.long, device=device)  # the same, on the device
        self._roots = torch.zeros(batch_size, dtype=torch.long, device=device)  # every row's next root token
        self.keys = [0] * batch_size  # every row's sampling key
        self._columns = torch.arange(0, device=device)  # 0, 1, 2 ...: column indices, grown as needed
        self._row_ids = torch.zeros(batch_size, 0, dtype=torch.long, device=device)  # row b's index, repeated
        self._pad = torch.zeros(0, dtype=torch.long, device=device)  # padding tokens' ids (any will do)
        self._drafters: tuple[Drafter, list[Drafter]] | None = None  # per slot, forked from the drafter served with
        self.clock = 0.0  # seconds of the engine's own work (prefills and steps)
        self._observing = 0.0  # seconds the last step's observe calls took (the next step's, as Engine.generate counts)
        self.forward_seconds = 0.0  # the last step's forward (when the engine times forwards)

    # ---- the rows' state -------------------------------------------------------------------------------------------

    def _grow(self, columns: int, width: int, pad: int) -> None:
        """Index tensors long enough for ``columns`` columns, paths of ``width`` and ``pad`` padding tokens."""
        device = self.engine.device
        if len(self._columns) < columns:
            self._columns = torch.arange(2 * columns, device=device)
        if self._row_ids.shape[1] < width:
            self._row_ids = torch.arange(self.batch_size, device=device)[:, None].repeat(1, 2 * width)
        if len(self._pad) < pad:
            self._pad = torch.zeros(2 * pad, dtype=torch.long, device=device)

    def _set_length(self, slot: int, length: int) -> None:
        self.lengths[slot] = length
        self._lengths[slot : slot + 1].fill_(length)  # a device fill: no host read

    def slot_drafters(self, drafter: Drafter) -> list[Drafter]:
        """``drafter`` for slot 0 and its forks for the others (made once per drafter, kept across serves)."""
        if self._drafters is None or self._drafters[0] is not drafter:
            drafter.attach(self.engine.model)
            self._drafters = (drafter, [drafter, *(drafter.fork() for _ in range(self.batch_size - 1))])
        return self._drafters[1]

    # ---- prefill and step ------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def prefill(self, slot: int, prompt_ids: list[int], drafter: Drafter, key: int = 0,
                max_new_tokens: int | None = None) -> Generation:
        """Start a generation in row ``slot``: prefill ``prompt_ids`` alone into that row (as batch size 1 does) and
        choose the first token. Raises PromptTooLong where the prompt fills the model's context."""
        eng = self.engine
        if max_new_tokens is not None and max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be positive, got {max_new_tokens}")
        if eng.max_length is not None and len(prompt_ids) >= eng.max_length:
            raise PromptTooLong(f"a prompt of {len(prompt_ids)} tokens leaves no room for an answer within the "
                                f"model's context of {eng.max_length} tokens")
        drafter.attach(eng.model)
        drafter.begin(eng.sampling, key)
        self.keys[slot] = key
        self.cache.reserve(len(prompt_ids) + (max_new_tokens or 0) + 64)
        prompt = torch.tensor(prompt_ids, dtype=torch.long, device=eng.device)
        eng.sync()
        start = time.perf_counter()
        layers = drafter.hidden_layers
        out = eng.model(input_ids=prompt[None], use_cache=True,
                        logits_to_keep=0 if drafter.needs_prefill_logits else 1,
                        output_hidden_states=list(layers) if layers else False, **{eng.cache_kw: self.cache.row(slot)})
        logits = out.logits[0]
        first = int(eng.sampling.choose(logits[-1:], key, len(prompt_ids)))  # the prefill's one host read
        self._roots[slot : slot + 1].fill_(first)
        self._set_length(slot, len(prompt_ids))
        self.cache.commit(max(self.lengths))
        drafter.reset(prompt, logits if drafter.needs_prefill_logits else None, Engine._hidden(out, layers))
        eng.sync()
        seconds = time.perf_counter() - start
        gen = Generation(output_ids=[first], prefill_time=seconds, slot=slot, started=self.clock)
        self.clock += seconds
        return gen

    def rewind(self, slot: int, length: int, root: int) -> None:
        """Row ``slot`` back to its first ``length`` entries with ``root`` as its next root (a calibration times the
        same step again)."""
        self._set_length(slot, length)
        self._roots[slot : slot + 1].fill_(root)
        self.cache.commit(max(self.lengths))

    def free(self, slot: int) -> None:
        """Row ``slot`` holds nothing (its columns are masked in every later step until it is prefilled again)."""
        self._set_length(slot, 0)
        self.cache.commit(max(self.lengths))

    @torch.inference_mode()
    def verify(self, drafts: dict[int, Draft | None], hidden_layers: Sequence[int] = ()) -> dict[int, Step]:
        """One step over the busy rows (``drafts``: slot -> its draft, None to verify its root alone) in one forward;
        every row's accepted KV entries are kept and its next root set. One host read for all rows."""
        eng = self.engine
        slots = sorted(drafts)
        rows = slots[-1] + 1  # the rows fed: up to the last busy one
        shapes = {s: drafts[s].shape if drafts[s] is not None else chain(0) for s in slots}
        context = max(self.lengths[s] for s in slots)  # C: every block goes after the longest prefix
        size = eng.fed_size(max(shape.size for shape in shapes.values()), context)
        width = max(max(shape.depth_list[: shape.n_nodes]) for shape in shapes.values()) + 1
        self._grow(context + size, width, size)
        blocks, fed = {}, []
        for r in range(rows):
            shape = shapes.get(r)
            if shape is None:  # an idle row inside the batch: padding alone
                fed.append((padded(chain(0), size - 1), self._pad[:size]))
                continue
            draft = drafts[r]
            root = self._roots[r : r + 1]
            block = root.clone() if draft is None else torch.cat([root, draft.tokens])
            blocks[r] = block
            extra = size - shape.size
            fed.append((padded(shape, extra), torch.cat([block, self._pad[:extra]])) if extra else (shape, block))
        buffers = [shape.buffers(eng.device, eng.dtype) for shape, _ in fed]
        positions = self._lengths[:rows, None] + torch.stack([b.depths for b in buffers])
        if eng.max_length is not None and context + size > eng.max_length:
            positions = positions.clamp(max=eng.max_length - 1)  # as Engine.verify: such nodes are never emitted
        self.cache.commit(context)
        if eng.time_forward:
            eng.sync()
            start = time.perf_counter()
        out = eng.model(
            input_ids=torch.stack([block for _, block in fed]),
            position_ids=positions,
            attention_mask=self._mask(rows, context, size, [b.mask_block for b in buffers]),
            use_cache=True,
            output_hidden_states=list(hidden_layers) if hidden_layers else False,
            **{eng.cache_kw: self.cache},
        )
        if eng.time_forward:
            eng.sync()
            self.forward_seconds = time.perf_counter() - start
        found = {}
        reads = []
        for s in slots:
            shape, block = shapes[s], blocks[s]
            buf = shape.buffers(eng.device, eng.dtype)
            logits = out.logits[s, : shape.size]
            pred = eng.sampling.choose(logits, self.keys[s], self.lengths[s] + 1, buf.depths,
                                       max(shape.depth_list) + 1)
            best, path_ids = accept(shape, buf, block, pred)
            bonus = pred.index_select(0, best)
            self._roots[s : s + 1].copy_(bonus)  # the next step's root, on the device
            reads += [best, block.index_select(0, path_ids), bonus]
            found[s] = (logits, pred, buf)
        picked = torch.cat(reads).tolist()  # the step's one host read, for every row
        steps, moves, at = {}, [], 0
        for s in slots:
            shape, (logits, pred, buf) = shapes[s], found[s]
            best, path, ranks, emitted = read_path(shape, buf, picked[at : at + picked_size(shape)])
            at += picked_size(shape)
            start_at, length = self.lengths[s], len(emitted)
            if start_at != context or shape.paths[best][-1] != length - 1:  # not already in place
                moves.append((self._row_ids[s, :length], self._columns[start_at : start_at + length], path + context))
            self._set_length(s, start_at + length)
            hidden = None
            if hidden_layers:
                states = [out.hidden_states[i][s, : shape.size] for i in hidden_layers]
                hidden = states[0] if len(states) == 1 else torch.cat(states, -1)
            steps[s] = Step(position=start_at, shape=shape, tokens=blocks[s], logits=logits, predictions=pred,
                            accepted=path, path_ranks=ranks, emitted=emitted, hidden_states=hidden, fed=size,
                            rows=len(slots))
        if moves:
            self.cache.move(*(torch.cat(parts) for parts in zip(*moves)))
        self.cache.commit(max(self.lengths))
        return steps

    def _mask(self, rows: int, context: int, size: int, blocks: list[torch.Tensor]) -> torch.Tensor:
        """Additive float mask [rows, 1, size, context + size]: row b sees its prefix [0, L_b) and its block's tree."""
        dtype = self.engine.dtype
        mask = torch.empty(rows, size, context + size, dtype=dtype, device=self.engine.device)
        hole = self._columns[None, :context] >= self._lengths[:rows, None]  # [rows, context]
        mask[:, :, :context] = torch.zeros(rows, context, dtype=dtype, device=hole.device).masked_fill_(
            hole, self.engine._min)[:, None, :]
        mask[:, :, context:] = torch.stack(blocks)
        return mask[:, None]

    # ---- serving ---------------------------------------------------------------------------------------------------

    def serve(self, sessions: Iterable[Session], drafter: Drafter) -> Iterator[int]:
        """Serve ``sessions`` in turn, ``batch_size`` at a time; a generator that yields after every step (the
        number of busy rows), so that a caller can run several engines step by step in turn. Run it to its end:
        ``for _ in engine.serve(...): pass``.

        An exception raised for one request (its prefill: a prompt too long for the model; its drafter's propose or
        observe) is thrown into its session, which may end or ask for another; one of the forward fails the serve.
        """
        drafters = self.slot_drafters(drafter)
        pending = iter(sessions)
        rows: list[_Row | None] = [None] * self.batch_size
        for slot in range(self.batch_size):
            rows[slot] = self._advance(slot, None, None, pending, drafters[slot])
        while any(rows):
            self._step(rows)
            for slot, row in enumerate(rows):
                if row is not None and row.done:
                    reply = row.error if row.error is not None else row.gen
                    rows[slot] = self._advance(slot, row.session, reply, pending, drafters[slot])
            yield sum(row is not None for row in rows)

    def _advance(self, slot: int, session: Session | None, reply: Generation | BaseException | None,
                 pending: Iterator[Session], drafter: Drafter) -> _Row | None:
        """Hand ``reply`` to ``session`` (None: start the next pending session) and prefill the request it makes in
        row ``slot``; a session that ends gives the row to the next. None: no session is left for the row."""
        while True:
            if session is None:
                session = next(pending, None)
                if session is None:
                    self.free(slot)
                    return None
                reply = None
            try:
                if isinstance(reply, BaseException):
                    request = session.throw(reply)
                else:
                    request = next(session) if reply is None else session.send(reply)
            except StopIteration:
                session = None
                continue
            try:
                row = self._start(slot, session, request, drafter)
            except Exception as err:  # noqa: BLE001 -- the request's own failure: its session decides
                reply = err
                continue
            if not row.done:
                return row
            reply = row.gen

    def _start(self, slot: int, session: Session, request: Request, drafter: Drafter) -> _Row:
        eng = self.engine
        prompt, budget = list(request.prompt_ids), request.max_new_tokens
        gen = self.prefill(slot, prompt, drafter, request.key, budget)
        limit = len(prompt) + budget if eng.max_length is None else min(len(prompt) + budget, eng.max_length)
        row = _Row(session, drafter, prompt + gen.output_ids, limit, budget, gen, self.clock)
        if row.ids[-1] in eng.eos or len(row.ids) >= limit:
            self._finish(row)
        return row

    def _finish(self, row: _Row) -> None:
        gen, eng = row.gen, self.engine
        gen.decode_time = self.clock - row.decoding
        gen.forward_time = row.forward if eng.time_forward else None
        gen.end = "stop" if row.ids[-1] in eng.eos else "budget" if len(gen.output_ids) >= row.max_new_tokens \
            else "context"
        gen.drafter_stats = row.drafter.finish()
        gen.finished = self.clock

    def _step(self, rows: list[_Row | None]) -> None:
        """Propose for every busy row, verify all in one forward, then let the rows observe in slot order."""
        start = time.perf_counter()
        drafts: dict[int, Draft | None] = {}
        for slot, row in enumerate(rows):
            if row is not None:
                try:
                    drafts[slot] = row.drafter.propose(row.ids)
                except Exception as err:  # noqa: BLE001 -- this row's drafter alone failed
                    row.error = err
        if not drafts:
            return
        layers = next(rows[s].drafter.hidden_layers for s in drafts)
        steps = self.verify(drafts, layers)
        seconds = time.perf_counter() - start + self._observing
        mark = time.perf_counter()
        for slot, step in steps.items():
            row = rows[slot]
            row.forward += self.forward_seconds
            step.seconds = seconds  # the batch's step, as Engine.generate times one
            step.emitted = self.engine._stop(step.emitted, row.limit - len(row.ids))
            gen = row.gen
            gen.output_ids += step.emitted
            gen.accept_lengths.append(len(step.emitted))
            gen.accept_paths.append(step.path_ranks[: len(step.emitted)])
            gen.block_sizes.append(step.fed)
            row.ids += step.emitted
            try:
                row.drafter.observe(step)
            except Exception as err:  # noqa: BLE001 -- this row's drafter alone failed
                row.error = err
        end = time.perf_counter()
        self._observing = end - mark
        self.clock += end - start
        for row in rows:
            if row is not None and row.error is None and (row.ids[-1] in self.engine.eos or len(row.ids) >= row.limit):
                self._finish(row)


def run_batch(engine: BatchEngine, sessions: Iterable[Session], drafter: Drafter) -> None:
    """Serve ``sessions`` to the end."""
    for _ in engine.serve(sessions, drafter):
        pass

