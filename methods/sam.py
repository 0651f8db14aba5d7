"""SAM-Decoding (Hu et al., 2024, arXiv 2411.10666): suffix-automaton retrieval with an auxiliary drafter.

A suffix automaton over prompt + output, extended as tokens are emitted, tracks the longest suffix of the
context that occurred earlier and where that occurrence ends. When the match is at least ``threshold``
tokens long, the tokens that followed it are drafted as a chain; otherwise the auxiliary drafter (Token
Recycling by default) drafts. An optional static automaton over a corpus competes with the context's
match, handicapped by ``bias`` tokens, as in the published code. ``mode="merge"`` verifies the chain and the
auxiliary tree together, merged into one trie. ``mode=auto`` hands over a
:class:`~methods.tree_search.PolicyPlan`: what to verify (the chain cut to some length, the auxiliary tree,
both, or nothing) by the match length and the context length, chosen for the hardware from statistics this
drafter scores itself (``score``) and the device calibration.

Which earlier occurrence is copied: the match keeps following the occurrence it was copying while the
context keeps repeating it (a copy in progress stays on its source). When it has to re-anchor (a shorter
suffix after a mismatch), it takes the end position recorded on the automaton state: the last position at
which the class was created, split, or held the text's longest repeated suffix (the class a re-anchored
match most often lands in), so usually its most recent end (the published code keeps the earliest end of
every class). The exact most recent end of every class would cost a walk up the suffix links per token,
O(context) on a repetitive text; this costs O(1).
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable, Literal, Mapping

import torch

from methods.drafter import Drafter, Step
from methods.recycling import TokenRecycling
from methods.tree_search import MAX_CLASS, PolicyPlan, TreePlan
from methods.tree import Draft, TreeShape, chain, interned, load_template

SEPARATOR = -1  # between corpus documents: never a context token, so no match spans two documents


class SuffixAutomaton:
    """The suffix automaton of a growing token list (Blumer et al.), in parallel lists for speed.

    State ``s`` stands for the substrings that share one set of end positions; ``end[s]`` is one of
    them (the last position when ``s`` was created, split off, or the longest repeated suffix).
    """

    def __init__(self) -> None:
        self.next: list[dict[int, int]] = [{}]
        self.link = [-1]
        self.length = [0]
        self.end = [-1]
        self.text: list[int] = []
        self._last = 0

    def __len__(self) -> int:
        return len(self.text)

    def extend(self, token: int) -> None:
        """Append ``token`` to the text (amortised O(1))."""
        i = len(self.text)
        self.text.append(token)
        nxt, link, length, end = self.next, self.link, self.length, self.end
        cur = len(length)
        nxt.append({})
        link.append(0)
        length.append(length[self._last] + 1)
        end.append(i)
        p = self._last
        while p != -1 and token not in nxt[p]:
            nxt[p][token] = cur
            p = link[p]
        if p != -1:
            q = nxt[p][token]
            if length[p] + 1 == length[q]:
                link[cur] = q
            else:  # split q: the clone keeps the shorter strings, which now also end at i
                clone = len(length)
                nxt.append(dict(nxt[q]))
                link.append(link[q])
                length.append(length[p] + 1)
                end.append(i)
                while p != -1 and nxt[p].get(token) == q:
                    nxt[p][token] = clone
                    p = link[p]
                link[q] = link[cur] = clone
        end[link[cur]] = i  # the longest repeated suffix: where a re-anchored match most often lands
        self._last = cur


@dataclass
class Match:
    """The longest suffix of a token stream that occurs in an automaton's text, and where it ends there."""

    state: int = 0
    length: int = 0
    end: int = -1

    def advance(self, sam: SuffixAutomaton, token: int) -> None:
        """Extend the stream by ``token`` (amortised O(1)); the match is against ``sam``'s current text."""
        nxt, link, length, text = sam.next, sam.link, sam.length, sam.text
        s, n = self.state, self.length
        while s and n <= length[link[s]]:  # s was split since: the match now lies in the shorter part
            s = link[s]
        if n and self.end + 1 < len(text) and text[self.end + 1] == token:  # the copied occurrence goes on
            self.state, self.length, self.end = nxt[s][token], n + 1, self.end + 1
            return
        while s and token not in nxt[s]:
            s = link[s]
            n = length[s]
        t = nxt[s].get(token)
        if t is None:
            self.state, self.length, self.end = 0, 0, -1
        else:
            self.state, self.length, self.end = t, n + 1, sam.end[t]


class Context:
    """Prompt + output so far: its automaton and the longest suffix that occurred earlier in it."""

    def __init__(self) -> None:
        self.sam = SuffixAutomaton()
        self.match = Match()

    def append(self, token: int) -> None:
        self.match.advance(self.sam, token)  # against the text before this token: an earlier occurrence
        self.sam.extend(token)


def load_corpus(path: str | Path, vocab_size: int) -> SuffixAutomaton:
    """The static automaton of a corpus file (``method.corpus``), built once per file version and cached.

    The file has one document per line, each a JSON list of token ids of the target model's tokenizer.
    """
    path = Path(path).expanduser().resolve()
    if not path.is_file():
        raise FileNotFoundError(f"method.corpus={str(path)!r}: no such file; give a file of token-id lists "
                                "(one JSON list per line), or method.corpus=null for none")
    stat = path.stat()
    return _build_corpus(path, stat.st_mtime_ns, stat.st_size, vocab_size)


@lru_cache(maxsize=4)
def _build_corpus(path: Path, mtime_ns: int, size: int, vocab_size: int) -> SuffixAutomaton:
    sam = SuffixAutomaton()
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"method.corpus={str(path)!r} is unreadable ({err}); it must be a text file of "
                         "token-id lists, one JSON list per line") from err
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            ids = json.loads(line)
        except json.JSONDecodeError:
            ids = None
        if not isinstance(ids, list) or not all(type(t) is int and 0 <= t < vocab_size for t in ids):
            raise ValueError(f"method.corpus={str(path)!r}, line {number}: expected a JSON list of token ids in "
                             f"0..{vocab_size - 1} (the target tokenizer's ids), got {line[:80]!r}")
        for t in ids:
            sam.extend(t)
        sam.extend(SEPARATOR)
    if not len(sam):
        raise ValueError(f"method.corpus={str(path)!r} holds no tokens")
    return sam


AUXILIARIES = ("recycling", "none")


class SamDecoding(Drafter):
    """The SAM-Decoding drafter: a retrieved chain when the match is long enough, else the auxiliary's draft.

    ``sources`` counts the steps by what was verified: ``retrieval`` (the chain alone), ``aux`` (the
    auxiliary's draft alone), ``merged`` (both, ``mode="merge"``), ``none`` (no draft at all); every
    turn's counts go into its result record (``drafter_stats``).

    ``score=n`` (statistics for ``mode=auto``): at every step, the chain of ``n`` tokens and the auxiliary's
    draft are also scored against the true continuation, whatever was verified; ``finish`` reports how
    many steps of each match-length class accepted how deep in each (``policy_shadow``).
    """

    tree_param = "aux_tree"  # auto: the fallback's tree chosen for the hardware from Token Recycling's statistics
    tree_owner = "recycling"
    policy_param = "mode"  # auto: what to verify by match length, from this drafter's own scored statistics
    score_param = "score"
    candidate_score = 32  # the chain length scored for those statistics (long matches often copy 16+ tokens)
    policy_replaces = ("threshold", "max_chain", "factor", "offset")

    @classmethod
    def aux_nodes(cls, params: Mapping, overrides: Mapping) -> Callable[[int], int]:
        if params.get("aux", "recycling") == "none":
            return lambda context: 0
        tree = overrides.get("aux_tree", params.get("aux_tree", "paper-b3"))
        if isinstance(tree, TreePlan):
            return lambda context: tree.choices[tree.index(context)].n_nodes
        size = len(load_template(tree) if isinstance(tree, str) else tree)
        return lambda context: size

    def __init__(
        self,
        vocab_size: int,
        device: torch.device | str = "cpu",
        threshold: int = 4,
        max_chain: int = 10,
        factor: float = 0.0,
        offset: float = 0.0,
        mode: Literal["switch", "merge"] | PolicyPlan = "switch",
        aux: str = "recycling",
        aux_tree: str | TreePlan = "paper-b3",
        k: int = 8,
        corpus: str | None = None,
        bias: int = 4,
        score: int = 0,
    ):
        if threshold < 1:
            raise ValueError(f"method.threshold must be at least 1 (a match length in tokens), got {threshold}")
        if max_chain < 1:
            raise ValueError(f"method.max_chain must be at least 1, got {max_chain}")
        if factor < 0:
            raise ValueError(f"method.factor must be >= 0 (0: every chain is max_chain long), got {factor}")
        if isinstance(mode, str) and mode not in ("switch", "merge"):
            raise ValueError(f"method.mode must be 'switch', 'merge' or 'auto', got {mode!r}")
        if score < 0:
            raise ValueError(f"method.score must be >= 0 (the chain length scored for statistics), got {score}")
        if aux not in AUXILIARIES:
            raise ValueError(f"method.aux must be one of {', '.join(AUXILIARIES)}, got {aux!r}")
        super().__init__(vocab_size, device)
        self.static = load_corpus(corpus, vocab_size) if corpus is not None else None
        self.aux = TokenRecycling(vocab_size, device, tree=aux_tree, k=k) if aux == "recycling" else None
        self.needs_prefill_logits = self.aux is not None and self.aux.needs_prefill_logits
        self.threshold, self.max_chain, self.factor, self.offset = threshold, max_chain, factor, offset
        self.mode, self.bias = mode, bias
        self.policy = None if isinstance(mode, str) else mode  # a PolicyPlan, fixed or correcting itself
        self.score = max(score, self.policy.scores if self.policy is not None else 0)  # a self-correcting policy learns from scores
        self.context = Context()
        self.corpus_match = Match()
        self.sources: Counter[str] = Counter()
        self._reported: Counter[str] = Counter()
        self._children: tuple[TreeShape | None, list[list[int]]] = (None, [])
        self._scored: Counter[tuple[int, int, int]] = Counter()  # (class, chain depth, aux depth) -> steps
        self._pending: list[tuple[int, int, int, list[int], list[int], tuple[int, ...]]] = []
        self._stream: list[int] = []  # tokens emitted since the first step of the generation

    def finish(self) -> dict:
        turn = self.sources - self._reported
        self._reported = self.sources.copy()
        facts: dict = {"sources": dict(turn)}
        if self.score:
            self._score_pending(final=True)
            facts["policy_shadow"] = {f"{m}:{c}:{a}": n for (m, c, a), n in sorted(self._scored.items())}
            self._scored.clear()
            self._stream = []
        if self.policy is not None:
            facts |= self.policy.report()
        return facts

    def reset(self, prompt: torch.Tensor, prefill_logits: torch.Tensor | None,
              prefill_hidden: torch.Tensor | None = None) -> None:
        self.context = Context()
        self.corpus_match = Match()
        self._pending, self._stream = [], []
        self._follow(prompt.tolist())
        if self.aux is not None:
            self.aux.reset(prompt, prefill_logits, prefill_hidden)

    def _follow(self, tokens: list[int]) -> None:
        for t in tokens:
            self.context.append(t)
            if self.static is not None:
                self.corpus_match.advance(self.static, t)

    def retrieve(self, ids: list[int], longest: int | None = None) -> tuple[list[int], int]:
        """The chain copied after the best match of ``ids``' suffix, and that match's (biased) length.
        ``longest``: that many tokens, whatever the match length (else as ``max_chain``/``factor`` say)."""
        self._follow(ids[len(self.context.sam):])
        match = self.context.match
        if self.static is not None and self.corpus_match.length - self.bias > match.length:
            match = self.corpus_match
            length = longest or self._chain_length(match.length - self.bias)
            text = self.static.text
            tokens = text[match.end + 1 : match.end + 1 + length]
            if SEPARATOR in tokens:  # the document ends
                tokens = tokens[: tokens.index(SEPARATOR)]
            return tokens, match.length - self.bias
        if not match.length:
            return [], 0
        length = longest or self._chain_length(match.length)
        # As PLD does: a copy that reaches the end of the context goes on through the copy itself.
        span = ids[match.end + 1 : match.end + 1 + length]
        return (span * (length // len(span) + 1))[:length], match.length

    def _chain_length(self, match_length: int) -> int:
        """``max_chain``, or SuffixDecoding's ``factor * match_length + offset`` capped at it."""
        if not self.factor:
            return self.max_chain
        return max(1, min(self.max_chain, int(self.factor * match_length + self.offset)))

    def propose(self, ids: list[int]) -> Draft | None:
        if self.policy is None and not self.score:
            tokens, length = self.retrieve(ids)
            return self._draft(ids, tokens, length >= self.threshold and bool(tokens))
        longest = max(self.score, self.max_chain if self.policy is None else self.policy.max_chain)
        tokens, length = self.retrieve(ids, longest)
        klass = min(length, MAX_CLASS)
        aux = self.aux.propose(ids) if self.aux is not None else None
        if self.score:
            self._pending.append((len(self._stream), len(ids), klass, tokens[: self.score],
                                  aux.tokens.tolist() if aux is not None else [],
                                  aux.shape.parents if aux is not None else ()))
        if self.policy is None:
            cut = tokens[: self._chain_length(length)]
            return self._draft(ids, cut, length >= self.threshold and bool(cut), aux)
        option = self.policy.option(len(ids), klass)
        return self._verify(tokens[: option.chain], aux if option.aux else None)

    def _draft(self, ids: list[int], tokens: list[int], retrieved: bool, aux: Draft | None = None) -> Draft | None:
        """What ``mode`` switch or merge verifies (``aux``: the auxiliary's draft, if already made)."""
        if self.aux is None:
            self.sources["retrieval" if retrieved else "none"] += 1
            return self._chain(tokens) if retrieved else None
        if retrieved and self.mode == "switch":
            self.sources["retrieval"] += 1
            return self._chain(tokens)
        draft = aux if aux is not None else self.aux.propose(ids)
        if not retrieved:
            self.sources["aux" if draft is not None else "none"] += 1
            return draft
        if draft is None:  # the fallback drafts nothing here (aux_tree=auto found no tree worth its cost)
            self.sources["retrieval"] += 1
            return self._chain(tokens)
        self.sources["merged"] += 1
        return self._merge(draft, tokens)

    def _verify(self, tokens: list[int], aux: Draft | None) -> Draft | None:
        """The policy's option: the chain, the auxiliary's draft, both merged, or nothing."""
        source = "merged" if tokens and aux is not None else "retrieval" if tokens else "aux" if aux is not None else "none"
        self.sources[source] += 1
        if source == "merged":
            return self._merge(aux, tokens)
        return self._chain(tokens) if tokens else aux

    def _chain(self, tokens: list[int]) -> Draft:
        return Draft(torch.tensor(tokens, dtype=torch.long, device=self.device), chain(len(tokens)))

    def _merge(self, draft: Draft, tokens: list[int]) -> Draft:
        """``draft``'s tree with the chain ``tokens`` inserted from the root as into a trie."""
        shape = draft.shape
        if self._children[0] is not shape:
            children: list[list[int]] = [[] for _ in range(shape.n_nodes)]
            for i, p in enumerate(shape.parents, start=1):
                children[p].append(i)
            self._children = (shape, children)
        children = self._children[1]
        block = [-1] + draft.tokens.tolist()
        node, j = 0, 0
        while j < len(tokens):
            node_next = next((c for c in children[node] if block[c] == tokens[j]), None)
            if node_next is None:
                break
            node, j = node_next, j + 1
        if j == len(tokens):
            return draft
        n1 = shape.n_nodes
        tail = tokens[j:]
        parents = shape.parents + (node,) + tuple(range(n1, n1 + len(tail) - 1))
        extra = torch.tensor(tail, dtype=torch.long, device=self.device)
        return Draft(torch.cat([draft.tokens, extra]), interned(parents))

    def observe(self, step: Step) -> None:
        if self.aux is not None:  # whichever draft was verified: the matrix learns from every forward
            self.aux.observe(step)
        if self.policy is not None:
            self.policy.observe_cost(step.position + 1, step.fed, step.seconds, 1 / step.rows)
        if self.score:
            self._stream += step.emitted
            self._score_pending(final=False)

    def _score_pending(self, final: bool) -> None:
        """Score the chains and auxiliary drafts whose continuation is known (greedy output does not depend
        on the drafts, so how deep each would have been accepted is exact). At the end of a generation the
        continuation is cut, and so are the depths."""
        waiting = []
        for start, context, klass, tokens, aux_tokens, parents in self._pending:
            truth = self._stream[start : start + max(len(tokens), len(parents))]
            if len(truth) < max(len(tokens), len(parents)) and not final:
                waiting.append((start, context, klass, tokens, aux_tokens, parents))
                continue
            depth = 0
            while depth < min(len(tokens), len(truth)) and tokens[depth] == truth[depth]:
                depth += 1
            node_depth, aux_depth = [0], 0  # -1: the node's path is not the continuation
            for node, parent in enumerate(parents, start=1):
                d = node_depth[parent] + 1 if node_depth[parent] >= 0 else -1
                ok = 0 < d <= len(truth) and aux_tokens[node - 1] == truth[d - 1]
                node_depth.append(d if ok else -1)
                aux_depth = max(aux_depth, d if ok else 0)
            self._scored[klass, depth, aux_depth] += 1
            if self.policy is not None:
                self.policy.observe_scored(klass, depth, aux_depth, context)
        self._pending = waiting

    def describe(self) -> dict:
        facts: dict = {"mode": "auto" if self.policy else self.mode,
                       "corpus_tokens": len(self.static) if self.static is not None else 0}
        if self.policy:
            facts["policy"] = self.policy.describe()
        if self.aux is not None:
            facts["aux"] = self.aux.describe()
        return facts

    def shared(self) -> list[object]:
        """The corpus automaton (read-only), the policy and the fallback's hot-start state are the batch's; the
        context's automaton, the match and the counters are each row's own."""
        return [self.static, self.policy, *(self.aux.shared() if self.aux is not None else [])]

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {f"aux.{k}": v for k, v in self.aux.state_dict().items()} if self.aux is not None else {}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if self.aux is not None:
            self.aux.load_state_dict({k.removeprefix("aux."): v for k, v in state.items()})
