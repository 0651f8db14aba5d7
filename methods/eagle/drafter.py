"""EAGLE drafting on the shared engine: a draft head over the target's features grows the draft tree.

The head (:mod:`methods.eagle.head`) pairs the target's feature at position t with the embedding of
token t+1 and predicts the feature at t+1; the target's lm_head (EAGLE-1) or the head's own (EAGLE-3)
turns it into next-token log-probs. The head names the target layers it reads (``hidden_layers``). Its
KV cache holds one entry per context position, always computed from the target's own features (the
engine hands them over: the prompt's at ``reset``, the accepted path's in every ``Step``), never from
the head's guesses; the entries of a step's draft tree are dropped as soon as the tree is drafted.

Two trees: a static template (``tree=<name>``, rank paths as Token Recycling's: node ``[0, 1]`` is the
second most likely child of the most likely first token; ``tree=auto``: one per context bucket, chosen for
the hardware from the head's measured acceptance and drafting time), or EAGLE-2's dynamic tree (``tree=dynamic``):
from the root, expand the ``top_k`` candidates of highest cumulative log-probability at every depth, each
into its ``top_k`` children, then keep the ``total_tokens - 1`` best of all candidates. Each depth is one
head forward over the expanded nodes (siblings share a position; each sees the context and its own
ancestors). The dynamic tree's shape changes from step to step; shapes are interned
(:func:`methods.tree.interned`), so a recurring tree reuses its buffers.

Under sampling (``sampling.temperature > 0``) the tree is filled as above (``draft=topk``), or with the target's
public noise (``draft=coupled``, the drafter-invariant scheme of Daliri et al., arXiv 2408.07978): a node's
first child is the head's own draw under the target's rule, ``argmax(log q / T + G)`` over the tokens the
target's top-k / top-p keep of q, with the noise G of the position it predicts, so that a head that matches the
target drafts the target's very sample; its next children follow by ``log q / T + G`` (samples without
replacement from the head's tempered distribution, with the same noise). The dynamic tree scores a node's first
child as its parent (a log-prob of 0), so the chain of first children is the tree's best branch. At T = 0 the
two options draft alike.

A head trained here ships its draft vocabulary (``draft_vocab.safetensors``: the target ids it drafts
over, as EAGLE-3's ``d2t``): the head's next-token log-probs are over those rows of the lm_head only,
which cuts the drafting's largest cost, the output projection, by V/N. Verification is untouched.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from transformers import DynamicCache, PreTrainedModel

from methods.drafter import Drafter, Step
from methods.eagle.head import Eagle3Head, EagleHead, HeadError, load_draft_vocab, load_head
from methods.tree import Draft, from_rank_paths, interned
from methods.tree_search import TreePlan, as_plan


class Eagle(Drafter):
    """The EAGLE drafter: ``head`` is a checkpoint directory (EAGLE-1 or EAGLE-3 layout) or ``random`` (an
    untrained EAGLE-1 head, seeded: for tests and timing only); ``tree`` is ``dynamic`` (EAGLE-2) or a
    template name; ``draft_vocab``: True drafts over the head's draft vocabulary when it ships one, an
    int N over its N most frequent tokens, False over the whole vocabulary (an EAGLE-3 head always
    drafts over its own). A :class:`TreePlan` as ``tree`` (``tree=auto``) gives a template per context bucket.
    ``draft``: ``topk`` ranks a node's children by the head's log-probs, ``coupled`` by its draw with the target's
    sampling noise (the module's docstring; the same as ``topk`` for greedy decoding)."""

    hidden_layers = EagleHead.reads  # set by the head in attach (EAGLE-3 reads three layers)
    tree_param = "tree"
    candidate_tree = "wide"  # what the head drafts depends only on the context: verified as it is
    drafting_cost = True
    sampling_params = ("draft",)

    def __init__(
        self,
        vocab_size: int,
        device: torch.device | str = "cpu",
        head: str | None = None,
        tree: str | Sequence[Sequence[int]] | TreePlan = "dynamic",
        total_tokens: int = 60,
        depth: int = 6,
        top_k: int = 10,
        seed: int = 0,
        draft_vocab: bool | int = True,
        draft: str = "topk",
    ):
        super().__init__(vocab_size, device)
        if draft not in ("topk", "coupled"):
            raise ValueError(f"method.draft must be topk or coupled, got {draft!r}")
        if head is None:
            raise HeadError("method.head is not set and the model's config names no eagle_head: give the directory "
                            "of an EAGLE head for this model (config.json + model.safetensors), train one (make "
                            "train-eagle), or use method.head=random for an untrained one")
        if tree == "dynamic" and not (total_tokens >= 2 and depth >= 1 and top_k >= 1):
            raise ValueError(f"method.total_tokens (>= 2), method.depth and method.top_k (>= 1) must be positive, "
                             f"got {total_tokens}, {depth}, {top_k}")
        if isinstance(draft_vocab, int) and not isinstance(draft_vocab, bool) and draft_vocab < 1:
            raise ValueError(f"method.draft_vocab must be true, false or a positive count, got {draft_vocab}")
        self.head_source, self.seed, self.draft_vocab, self.draft = head, seed, draft_vocab, draft
        self._noise: torch.Tensor | None = None  # draft=coupled under sampling: T * noise per tree depth
        self.total_tokens, self.depth, self.top_k = total_tokens, depth, top_k
        self.plan = None if tree == "dynamic" else as_plan(tree)
        self._templates: dict[tuple, tuple] = {}  # per static tree: its levels (methods.eagle._levels), built once
        self.head: EagleHead | Eagle3Head | None = None
        self._target: PreTrainedModel | None = None
        self.cache = DynamicCache()
        self.cached = 0  # context positions in the head's cache
        self.features: list[torch.Tensor] = []  # target features not yet fed to the head
        self._eye = torch.eye(top_k, dtype=torch.bool, device=self.device)  # each expanded node sees itself

    def _template(self, paths: Sequence[Sequence[int]]) -> tuple | None:
        """A static tree's levels, built once per tree (None: no tree)."""
        key = tuple(map(tuple, paths))
        if key not in self._templates:
            self._templates[key] = self._levels(key, self.device) if key else None
        return self._templates[key]

    @staticmethod
    def _levels(paths: Sequence[Sequence[int]], device: torch.device) -> tuple:
        """A template's shape and, per depth, what one head forward needs: the nodes fed (those with
        children), their parents' rows among the previous depth's fed nodes, their visibility among all
        fed nodes, and the children they fill (block index, row among the fed nodes, rank)."""
        shape, ranks = from_rank_paths(paths)
        depth, ranks = shape.depth_list, ranks.tolist()
        has_children = set(shape.parents)
        fed: list[int] = []  # block indices in feeding order
        levels = []
        for d in range(0, max(depth) + 1):
            nodes = [i for i in range(shape.n_nodes) if depth[i] == d and i in has_children]
            if not nodes:
                break
            children = [(c, nodes.index(p), ranks[c - 1]) for c, p in enumerate(shape.parents, start=1) if p in nodes]
            rows = [fed.index(shape.parents[i - 1]) if d > 1 else -1 for i in nodes] if d > 0 else []
            visible = torch.tensor([[f in shape.paths[i] for f in fed + nodes] for i in nodes],
                                   device=device) if d > 0 else None
            levels.append((torch.tensor(nodes, device=device), rows, visible,
                           *(torch.tensor([c[j] for c in children], device=device) for j in range(3))))
            fed += nodes if d > 0 else []
        return shape, levels, max(ranks) + 1

    def attach(self, model: PreTrainedModel) -> None:
        if self._target is model:
            return
        rows = model.get_output_embeddings().weight.shape[0]
        if rows != self.vocab_size:
            raise HeadError(f"the model's lm_head has {rows} rows, the drafter was built for {self.vocab_size}")
        chosen = None
        if self.head_source == "random":
            torch.manual_seed(self.seed)
            head = EagleHead(model)
            if not isinstance(self.draft_vocab, bool):
                raise HeadError("method.draft_vocab: a random head has no draft vocabulary; use true or false")
        else:
            head = load_head(self.head_source, model)
            chosen = load_draft_vocab(self.head_source, self.draft_vocab, rows)
        self.head = head.eval()
        self.hidden_layers = head.reads
        self.embed = model.get_input_embeddings()
        # the draft vocabulary: its output rows, and their target ids (None: all of them, in order)
        self.vocab_rows, self.vocab_ids = head.draft_vocabulary(model, chosen)
        self._min = torch.finfo(model.dtype).min
        self._target = model

    def reset(self, prompt: torch.Tensor, prefill_logits: torch.Tensor | None,
              prefill_hidden: torch.Tensor | None = None) -> None:
        self.cache, self.cached, self.features = DynamicCache(), 0, [prefill_hidden]
        self.tokens = [prompt[1:]]  # the tokens after each fed feature, on the device (the first answer token: later)

    def observe(self, step: Step) -> None:
        if self.plan is not None:
            self.plan.observe(step.position + 1, step.fed, step.seconds, step.path_ranks, 1 / step.rows)
        # the features of the root and the accepted nodes whose next token was emitted (a stop may cut some),
        # and those next tokens, taken on the device: the accepted nodes and the bonus token
        n = len(step.emitted)
        self.features.append(step.hidden_states[step.accepted[:n]])
        self.tokens.append(torch.cat([step.tokens[step.accepted[1:]], step.predictions[step.accepted[-1:]]])[:n])

    @torch.inference_mode()
    def propose(self, ids: list[int]) -> Draft | None:
        template = None if self.plan is None else self._template(self.plan.trees[self.plan.index(len(ids))])
        if self.plan is not None and template is None:
            return None  # the plan drafts nothing at this context length; the head catches up later
        last = self._catch_up(ids)  # the head's prediction of the root's feature
        logp = self._logp(last)  # [N]: the first draft token's, over the draft vocabulary
        self._noise = None
        if self.draft == "coupled" and not self.sampling.greedy:  # depth d's children predict position len(ids) + d
            levels = self.depth if template is None else len(template[1])
            self._noise = self.sampling.noise(self.key, len(ids), levels, self.vocab_size, self.device,
                                              self.vocab_ids).mul_(self.sampling.temperature)
        draft = self._dynamic(logp, last) if template is None else self._fill(logp, ids[-1], last, template)
        self.cache.crop(self.cached - self.cache.get_seq_length())  # drop the tree's entries: the context's stay
        return draft

    def _catch_up(self, ids: list[int]) -> torch.Tensor:
        """Feed the head the pairs (target feature at t, token t+1) it has not seen; the last output."""
        features = torch.cat(self.features) if len(self.features) > 1 else self.features[0]
        self.features = []
        start, q = self.cached, features.shape[0]
        if start + q != len(ids) - 1:
            raise RuntimeError(f"EAGLE: {start + q} features for a context of {len(ids) - 1} tokens")
        if start == 0:  # the answer's first token came from the prefill: the one host write per generation
            self.tokens.append(torch.tensor(ids[len(ids) - 1 :], device=self.device))
        tokens = torch.cat(self.tokens) if len(self.tokens) > 1 else self.tokens[0]
        self.tokens = []
        positions = torch.arange(start, start + q, device=self.device)
        mask = None
        if q > 1:
            causal = positions[:, None] >= torch.arange(start + q, device=self.device)[None, :]
            mask = self._additive(causal)
        out = self.head(self.embed(tokens)[None], features[None], positions[None], mask, self.cache)
        self.cached += q
        return out[0, -1]

    def _logp(self, out: torch.Tensor) -> torch.Tensor:
        """Next-token log-probs over the draft vocabulary (indices into it; :meth:`_target_ids` maps them)."""
        return torch.log_softmax(F.linear(self.head.output_norm(out), self.vocab_rows), -1)

    def _ranked(self, logp: torch.Tensor, width: int, depth: int) -> torch.Tensor:
        """The ``width`` children [r, width] (indices into the draft vocabulary) of each of r nodes at ``depth``,
        best first, from their log-probs [r, N]: by log-prob, or (``draft=coupled`` under sampling) the head's draw
        under the target's rule first, then by log q + T * G."""
        if self._noise is None:
            return logp.topk(width, -1).indices
        scores = logp + self._noise[depth]
        drawn = self.sampling.select(logp, scores.clone())  # [r]: truncated as the target's choice is
        return scores.scatter_(-1, drawn[:, None], float("inf")).topk(width, -1).indices

    def _target_ids(self, index: torch.Tensor) -> torch.Tensor:
        return index if self.vocab_ids is None else self.vocab_ids[index]

    def _additive(self, visible: torch.Tensor) -> torch.Tensor:
        mask = torch.zeros(visible.shape, dtype=self.head.fc.weight.dtype, device=self.device)
        return mask.masked_fill_(~visible, self._min)[None, None]

    def _feed(self, tokens: torch.Tensor, parent_out: torch.Tensor, visible: torch.Tensor,
              depth: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One head forward over nodes at ``depth`` (tokens [q], their parents' outputs [q, h]): their outputs
        [q, h] and their children's log-probs [q, N] over the draft vocabulary. ``visible`` [q, fed + q]:
        which tree entries (fed so far, then these) each sees."""
        context = torch.ones(len(tokens), self.cached, dtype=torch.bool, device=self.device)
        positions = torch.full((1, len(tokens)), self.cached + depth - 1, device=self.device)
        out = self.head(self.embed(tokens)[None], parent_out[None], positions, self._additive(
            torch.cat([context, visible], 1)), self.cache)[0]
        return out, self._logp(out)

    def _fill(self, logp: torch.Tensor, root: int, root_out: torch.Tensor, template: tuple) -> Draft:
        """A static template (:meth:`_levels`), filled depth by depth from the head's ranked predictions."""
        shape, levels, width = template
        tokens = torch.empty(shape.n_nodes, dtype=torch.long, device=self.device)
        tokens[:1].fill_(root)
        fed_out = root_out.new_empty(0, root_out.shape[-1])  # outputs of the fed nodes, in feeding order
        for d, (nodes, rows, visible, children, parent_rows, ranks) in enumerate(levels):
            if d == 0:
                top = self._ranked(logp[None], width, 0)  # the root's children
            else:
                parents_out = root_out.expand(len(nodes), -1) if d == 1 else fed_out[rows]
                out, node_logp = self._feed(tokens[nodes], parents_out, visible, d)
                fed_out = torch.cat([fed_out, out])
                top = self._ranked(node_logp, width, d)
            tokens[children] = self._target_ids(top[parent_rows, ranks])
        return Draft(tokens[1:], shape)

    def _dynamic(self, logp: torch.Tensor, root_out: torch.Tensor) -> Draft:
        """EAGLE-2: expand the best ``top_k`` by cumulative log-prob per depth, keep the best overall."""
        k, dev = self.top_k, self.device
        scores, tokens = self._children(logp[None], k, 0)
        scores, tokens = scores[0], self._target_ids(tokens[0])
        all_tokens, all_scores, all_parents = [tokens], [scores], [torch.full((k,), -1, device=dev)]
        frontier, parent_out = torch.arange(k, device=dev), root_out.expand(k, -1)
        visible = self._eye
        count = k
        for d in range(1, self.depth):
            out, node_logp = self._feed(tokens, parent_out, visible, d)
            child_scores, child_tokens = self._children(node_logp, k, d)  # [k, k]
            child_tokens = self._target_ids(child_tokens)
            cum = (scores[:, None] + child_scores).flatten()
            all_tokens.append(child_tokens.flatten())
            all_scores.append(cum)
            all_parents.append(frontier.repeat_interleave(k))
            if d == self.depth - 1:
                break
            scores, best = cum.topk(k)
            rows = best // k
            tokens, parent_out, frontier = child_tokens.flatten()[best], out[rows], count + best
            visible = torch.cat([visible[rows], self._eye], 1)
            count += k * k
        cand_tokens, cand_scores = torch.cat(all_tokens), torch.cat(all_scores)
        parents = torch.cat(all_parents).tolist()
        keep = set(cand_scores.topk(min(self.total_tokens - 1, len(cand_scores))).indices.tolist())
        for c in list(keep):  # scores never rise along a path; on an exact tie keep the ancestors too
            while parents[c] >= 0 and parents[c] not in keep:
                c = parents[c]
                keep.add(c)
        depth = {}
        for c in sorted(keep):  # candidates are numbered depth by depth, parents first
            depth[c] = 1 if parents[c] < 0 else depth[parents[c]] + 1
        order = sorted(keep, key=lambda c: (depth[c], c))
        index = {c: i for i, c in enumerate(order, start=1)}
        shape = interned(tuple(index.get(parents[c], 0) for c in order))
        return Draft(cand_tokens[torch.tensor(order, device=dev)], shape)

    def finish(self) -> dict:
        return self.plan.report() if self.plan is not None else {}

    def shared(self) -> list[object]:
        """The target and the head are read-only, the plan the batch's; the head's KV cache is each row's own."""
        return [self._target, self.head, getattr(self, "embed", None), getattr(self, "vocab_rows", None),
                getattr(self, "vocab_ids", None), self.plan, self._templates]

    def _children(self, logp: torch.Tensor, k: int, depth: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A dynamic tree's ``k`` children per node: their scores (log-probs; under ``draft=coupled`` the drawn
        first child's is 0, so that it is scored as its parent) and indices, [r, k] each."""
        if self._noise is None:
            return logp.topk(k, -1)
        index = self._ranked(logp, k, depth)
        scores = logp.gather(-1, index)
        scores.narrow(-1, 0, 1).zero_()
        return scores, index

    def describe(self) -> dict:
        params = list(self.head.parameters()) if self.head is not None else []
        return {"head": str(self.head_source), "head_params": sum(p.numel() for p in params),
                "head_bytes": sum(p.numel() * p.element_size() for p in params),
                "draft_vocab": len(self.vocab_rows) if self.head is not None else None,
                "layers_read": list(self.hidden_layers),
                "tree": "dynamic" if self.plan is None else
                "static, " + " / ".join(f"{len(paths)} nodes" for paths in self.plan.trees),
                **({"plan": self.plan.describe()} if self.plan is not None and self.plan.sources else {})}
