"""The drafter interface: what a decoding method is on top of the shared engine.

A drafter proposes a :class:`~methods.tree.Draft` before each verification forward and observes what
the forward produced afterwards. It never touches the model or its cache: the engine owns both, so
every method is verified by the same code and compared like for like.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable, Mapping

import torch
from transformers import PreTrainedModel

from methods.sampling import Sampling
from methods.tree import Draft, TreeShape


class DrafterUnfit(ValueError):
    """A drafter that cannot serve this model (e.g. a draft head trained for another); says what to do."""


@dataclass
class Step:
    """One verification forward, as handed to :meth:`Drafter.observe`.

    Indices are block indices: 0 is the root, then the draft nodes, then the extra tokens.
    """

    position: int  # position of the root (prefix length before the step)
    shape: TreeShape
    tokens: torch.Tensor  # [size] block input ids
    logits: torch.Tensor  # [size, V] logits at every block position
    predictions: torch.Tensor  # [size] the choice rule's token after every block token (greedy: argmax of logits)
    accepted: torch.Tensor  # [L] block indices of the accepted path, root first
    path_ranks: list[int]  # sibling rank (TreeShape.sibling_ranks) of every accepted draft node, by depth
    emitted: list[int]  # tokens this step added to the output (accepted drafts + bonus, after stops)
    hidden_states: torch.Tensor | None  # [size, len(hidden_layers) x hidden]: the layers the drafter asked for
    fed: int = 0  # tokens fed to the forward (the block and its padding)
    seconds: float = 0.0  # wall time of the step as the engine ran it (propose, forward, acceptance, KV compaction)
    rows: int = 1  # the rows of a batch this forward verified: each of them reports the same step (and seconds)


class Drafter:
    """Base class of every method; the baseline is this class itself (it proposes nothing).

    Subclasses override what they need:

    * ``begin`` and ``reset`` at the start of every generation (each turn); hot-start state survives it by choice;
    * ``propose`` returns a draft, or ``None`` to verify the root alone;
    * ``observe`` sees every verification step;
    * ``shared`` names the state the rows of a batch share (``fork`` makes a drafter for another row).
    """

    #: ask the engine for logits at every prompt position in ``reset`` (costs a full-width lm_head)
    needs_prefill_logits: bool = False
    #: the target's hidden states the drafter needs, as indices into Hugging Face's ``hidden_states`` (0: the
    #: embeddings, i: the input of layer i, -1: the last layer's output after the final norm); the engine
    #: hands them over concatenated in this order, for the prompt (``reset``) and in every :class:`Step`
    hidden_layers: tuple[int, ...] = ()
    #: the constructor argument that sets the draft tree (or chain length); ``auto`` there lets the harness
    #: choose it for the hardware (evaluation.autotree) and hand over a :class:`~methods.tree_search.TreePlan`
    tree_param: str | None = None
    #: that argument's value while acceptance statistics are collected: a wide candidate tree
    candidate_tree: object = None
    #: for a drafter scored in a shadow (``shadow_param``): the tree a statistics pass verifies while it scores the
    #: candidate, where the method's default would be a costly choice for that (None: the method's default)
    statistics_tree: object = None
    #: the method (``conf/method/<name>.yaml``) whose acceptance statistics choose ``tree_param``, when that tree
    #: is the one of a drafter this one contains (SAM's fallback: recycling); None: this method's own
    tree_owner: str | None = None
    #: the constructor argument that takes a tree to score in the shadow of the verified one
    #: (:class:`~methods.tree_search.ShadowTree`), for drafters whose state learns from what is verified;
    #: None: statistics come from verifying the candidate tree itself
    shadow_param: str | None = None
    #: the drafter runs forwards of its own per draft (EAGLE's head, one per depth), too costly to leave out of
    #: a tree's step time: ``tree=auto`` adds it, as ``evaluation.calibrate method=<name>`` measured it
    drafting_cost: bool = False
    #: the constructor argument that takes a per-step policy (:class:`~methods.tree_search.PolicyPlan`: what to
    #: verify by a class the drafter knows before drafting, e.g. SAM's match length); ``auto`` there lets the
    #: harness choose it from the drafter's own per-class statistics; None: no such policy
    policy_param: str | None = None
    #: the constructor argument that makes the drafter score its candidate chain and auxiliary draft at every
    #: step (``finish`` reports ``policy_shadow``), and the chain length scored
    score_param: str | None = None
    candidate_score: int = 0
    #: settings a policy replaces (left out of its statistics' key)
    policy_replaces: tuple[str, ...] = ()
    #: constructor arguments that change the drafts only under sampling (EAGLE's ``draft``): left out of the keys
    #: of greedy decoding's statistics and drafting calibrations
    sampling_params: tuple[str, ...] = ()

    @classmethod
    def aux_nodes(cls, params: Mapping, overrides: Mapping) -> Callable[[int], int]:
        """For a policy (``policy_param``): the draft nodes of the auxiliary tree a step may verify besides the
        chain, by context length, given the method's settings and the harness's resolved ``overrides``."""
        return lambda context: 0

    def __init__(self, vocab_size: int, device: torch.device | str = "cpu"):
        self.vocab_size = vocab_size  # the model's logit width (may exceed len(tokenizer))
        self.device = torch.device(device)
        self.sampling, self.key = Sampling(), 0  # the engine's choice rule, set by begin

    def attach(self, model: PreTrainedModel) -> None:
        """Take what the drafter needs of the target model itself (its config, embeddings, lm_head): called
        by the harness before any question, so that a drafter that does not fit the model fails at once,
        and by :meth:`Engine.generate` (then a no-op for the same model)."""

    def begin(self, sampling: Sampling, key: int) -> None:
        """The engine's choice rule for the generation about to start (called before ``reset``): its settings and
        the generation's key, kept as ``self.sampling`` and ``self.key`` so that a drafter may draft with the
        target's public noise (``self.sampling.noise(self.key, position, ...)``); most drafters ignore them."""
        self.sampling, self.key = sampling, key

    def reset(self, prompt: torch.Tensor, prefill_logits: torch.Tensor | None,
              prefill_hidden: torch.Tensor | None = None) -> None:
        """Start a generation for ``prompt`` ([P] ids); ``prefill_logits`` is [P, V] if requested,
        ``prefill_hidden`` [P, len(hidden_layers) x hidden] if ``hidden_layers`` asks for any."""

    def propose(self, ids: list[int]) -> Draft | None:
        """Draft the continuation of ``ids`` (prompt + output so far; ``ids[-1]`` is the root)."""
        return None

    def observe(self, step: Step) -> None:
        """Learn from a verification step."""

    def finish(self) -> dict:
        """Facts about the generation that just ended (counters), recorded with its turn; {} for none."""
        return {}

    def describe(self) -> dict:
        """Facts about the drafter worth printing and recording with a run (e.g. memory used)."""
        return {}

    def fork(self) -> Drafter:
        """A drafter for another row of a batch (:mod:`methods.batch`): the same settings and its own per-generation
        state, but the very objects :meth:`shared` names, not copies of them. Made after ``attach``."""
        return copy.deepcopy(self, {id(obj): obj for obj in self.shared()})

    def shared(self) -> list[object]:
        """What every row of a batch shares rather than copies: hot-start state that all rows read and update (in
        slot order after every step: :mod:`methods.batch`), a plan that corrects itself from every row's steps, and
        what is large and read-only (a model's modules, a corpus). None by default: each row starts from a copy."""
        return []

    def state_dict(self) -> dict[str, torch.Tensor]:
        """State that outlives a question (hot start), saved with the results so a resumed run continues it."""
        return {}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore what :meth:`state_dict` returned."""
