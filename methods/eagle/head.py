"""EAGLE draft heads: one decoder layer of the target's own type that predicts the target's next feature
from the current feature and the next token's embedding. EAGLE-1 (Li et al., 2024) below; EAGLE-3
(:class:`Eagle3Head`) fuses three layers and has its own output layer. :func:`load_head` tells them apart.

``fc`` maps ``[embedding of token t+1, target feature at t]`` (2h) to h, one decoder layer built from the
target's own layer class (layer 0 without its input norm, as published) turns that into the predicted
feature at t+1, and the target's frozen lm_head reads it. The embeddings and the lm_head are the target's
(tied or not); the head owns only ``fc`` and the layer, with the published state-dict keys (``fc.weight``,
``fc.bias``, ``layers.0.*``), so a published EAGLE-1 checkpoint loads as it is and ours is saved the same way.
A head trained here adds its draft vocabulary (``draft_vocab.safetensors``, ``tokens``: target ids, most
frequent first) and its training figures (``metrics.json``).
"""

from __future__ import annotations

import copy
import inspect
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

from methods.drafter import DrafterUnfit
from methods.engine import cache_keyword
from methods.paths import resolve_path

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
DRAFT_VOCAB_FILE = "draft_vocab.safetensors"


class HeadError(DrafterUnfit):
    """A draft head that cannot be loaded or does not fit the target; the message says what to do."""


def head_config(target: PretrainedConfig) -> PretrainedConfig:
    """The target's text config with one decoder layer: the head's layer is the target's layer type."""
    config = copy.deepcopy(target.get_text_config())
    config.num_hidden_layers = 1
    if getattr(config, "layer_types", None):
        config.layer_types = ["full_attention"]
    return config


class _Head(nn.Module):
    """What both heads share: the target's layer type and rotary embedding, and the cache keyword."""

    #: the target's hidden states the head reads (indices into Hugging Face's ``hidden_states``)
    reads: tuple[int, ...]

    def _from_target(self, target: PreTrainedModel) -> nn.Module:
        """A fresh decoder layer of the target's type (one-layer config); sets up the rotary embedding."""
        base = target.base_model
        if not hasattr(base, "layers") or not hasattr(base, "rotary_emb"):
            raise HeadError(f"an EAGLE head copies the target's decoder layer and rotary embedding; "
                            f"{type(target).__name__} has no base_model.layers / rotary_emb")
        self.config = head_config(target.config)
        self.rotary = type(base.rotary_emb)(config=self.config)
        # Gemma3-style rotary embeddings are per layer type; the head's one layer attends globally
        rotary_params = inspect.signature(type(self.rotary).forward).parameters
        self._rotary_args = ("full_attention",) if "layer_type" in rotary_params else ()
        return type(base.layers[0])(self.config, layer_idx=0)

    def _rope(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rotary(x, position_ids, *self._rotary_args)

    def draft_vocabulary(self, target: PreTrainedModel, chosen: torch.Tensor | None
                         ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The output rows the head drafts over and their target ids (None: all, in order)."""
        raise NotImplementedError


class EagleHead(_Head):
    """``fc`` + one decoder layer of the target's type; call it with the target's embedding and lm_head."""

    reads = (-1,)  # the last layer's output, after the final norm

    def __init__(self, target: PreTrainedModel, fc_bias: bool = True):
        super().__init__()
        layer = self._from_target(target)
        hidden = self.config.hidden_size
        self.fc = nn.Linear(2 * hidden, hidden, bias=fc_bias)
        layer.input_layernorm = nn.Identity()  # layer 0 has no input norm (EAGLE's cnets1.py)
        self.layers = nn.ModuleList([layer])
        self.output_norm = nn.Identity()  # the features are post-norm already: the lm_head reads them as they are
        self._cache_kw = cache_keyword(type(layer).forward)
        self.to(device=target.device, dtype=target.dtype)

    def forward(self, embeds: torch.Tensor, features: torch.Tensor, position_ids: torch.Tensor,
                mask: torch.Tensor | None, cache) -> torch.Tensor:
        """Predicted next features [1, q, h] of ``embeds`` and ``features`` [1, q, h] at ``position_ids`` [1, q];
        ``mask`` is an additive [1, 1, q, cached + q] mask (None: one query that sees everything)."""
        x = self.fc(torch.cat([embeds, features], -1))
        return self.layers[0](x, attention_mask=mask, position_ids=position_ids, use_cache=True,
                              position_embeddings=self._rope(x, position_ids), **{self._cache_kw: cache})

    def draft_vocabulary(self, target: PreTrainedModel, chosen: torch.Tensor | None
                         ) -> tuple[torch.Tensor, torch.Tensor | None]:
        rows = target.get_output_embeddings().weight.detach()
        return (rows, None) if chosen is None else (rows[chosen.to(rows.device)].contiguous(), chosen.to(rows.device))

    def save(self, directory: str | Path, metrics: dict | None = None, draft_vocab: torch.Tensor | None = None) -> None:
        """The published EAGLE-1 layout: ``config.json`` (the target's config, one layer, ``bias``) and
        ``model.safetensors``; ``metrics`` (training figures) and ``draft_vocab`` (target ids) beside them."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        config = self.config.to_dict() | {"bias": self.fc.bias is not None}
        (directory / "config.json").write_text(json.dumps(config, indent=1, default=str))
        save_file({k: v.contiguous() for k, v in self.state_dict().items()}, str(directory / "model.safetensors"))
        if metrics is not None:
            (directory / "metrics.json").write_text(json.dumps(metrics, indent=1))
        if draft_vocab is not None:
            save_file({"tokens": draft_vocab.to(torch.int32).contiguous()}, str(directory / DRAFT_VOCAB_FILE))


def _read_weights(directory: Path) -> dict[str, torch.Tensor]:
    for name in WEIGHT_FILES:
        path = directory / name
        if path.is_file():
            try:
                return load_file(str(path)) if name.endswith(".safetensors") else torch.load(
                    path, map_location="cpu", weights_only=True)
            except Exception as err:  # noqa: BLE001 -- any unreadable file gets the same advice
                raise HeadError(f"method.head={directory}: {name} is not readable ({err})") from err
    raise HeadError(f"method.head={directory}: no {' or '.join(WEIGHT_FILES)} there; give the directory of an "
                    "EAGLE head (config.json + weights), or train one (make train-eagle)")


class Eagle3Head(_Head):
    """EAGLE-3 (Li et al., 2025): ``fc`` fuses three of the target's layers (3h -> h, no bias); one
    ``midlayer`` of the target's type whose attention reads [input_layernorm(embedding),
    hidden_norm(feature)] (2h wide), with the residual taken from the un-normed feature; its own ``norm``
    and ``lm_head`` over a reduced vocabulary, whose draft id i is target id i + ``d2t[i]``. The module
    names are the published checkpoint's keys. Its features are pre-norm (inputs of the layers ``reads``);
    its own outputs, fed back while drafting, skip ``fc``."""

    NORMS = ("input_layernorm", "post_attention_layernorm")

    def __init__(self, target: PreTrainedModel, draft_vocab_size: int, reads: tuple[int, ...]):
        super().__init__()
        layer = self._from_target(target)
        hidden = self.config.hidden_size
        odd = [n for n in ("pre_feedforward_layernorm", "post_feedforward_layernorm") if hasattr(layer, n)]
        if odd or not all(hasattr(layer, n) for n in (*self.NORMS, "self_attn", "mlp")):
            raise HeadError(f"an EAGLE-3 head needs a Llama-style decoder layer (input_layernorm, self_attn, "
                            f"post_attention_layernorm, mlp); {type(layer).__name__} has {odd or 'another layout'}")
        self.reads = tuple(reads)
        self.fc = nn.Linear(len(self.reads) * hidden, hidden, bias=False)
        attention = layer.self_attn
        for name in ("q_proj", "k_proj", "v_proj"):  # they read [embedding, feature]
            old = getattr(attention, name)
            setattr(attention, name, nn.Linear(2 * hidden, old.out_features, bias=old.bias is not None))
        layer.hidden_norm = copy.deepcopy(layer.input_layernorm)
        self.midlayer = layer
        self.norm = copy.deepcopy(target.base_model.norm)
        self.lm_head = nn.Linear(hidden, draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.long))
        self._cache_kw = cache_keyword(type(attention).forward)
        self.to(device=target.device, dtype=target.dtype)

    @property
    def output_norm(self) -> nn.Module:
        return self.norm  # its outputs are pre-norm

    def forward(self, embeds: torch.Tensor, features: torch.Tensor, position_ids: torch.Tensor,
                mask: torch.Tensor | None, cache) -> torch.Tensor:
        """As :meth:`EagleHead.forward`; ``features`` are the target's fused layers [1, q, 3h] or the head's
        own previous outputs [1, q, h]."""
        hidden = self.fc(features) if features.shape[-1] == self.fc.in_features else features
        layer = self.midlayer
        x = torch.cat([layer.input_layernorm(embeds), layer.hidden_norm(hidden)], -1)
        attended, _ = layer.self_attn(hidden_states=x, attention_mask=mask, position_embeddings=self._rope(
            hidden, position_ids), use_cache=True, **{self._cache_kw: cache})
        hidden = hidden + attended
        return hidden + layer.mlp(layer.post_attention_layernorm(hidden))

    def draft_vocabulary(self, target: PreTrainedModel, chosen: torch.Tensor | None
                         ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if chosen is not None:
            raise HeadError("method.draft_vocab: an EAGLE-3 head drafts over its own lm_head's vocabulary; "
                            "leave method.draft_vocab=true")
        rows = self.lm_head.weight.detach()
        return rows, torch.arange(len(rows), device=rows.device) + self.d2t


def _eagle3_reads(config: dict, layers: int) -> tuple[int, ...]:
    """The target layers an EAGLE-3 head fuses: the config's ``eagle_aux_hidden_state_layer_ids`` (vLLM's
    name, also under ``eagle_config``), else the published (2, L//2, L-3): inputs of those layers."""
    reads = config.get("eagle_aux_hidden_state_layer_ids") or (config.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids") or (2, layers // 2, layers - 3)
    return tuple(int(i) for i in reads)


def load_head(directory: str | Path, target: PreTrainedModel) -> EagleHead | Eagle3Head:
    """An EAGLE-1 or EAGLE-3 head (by its keys) from a checkpoint directory (relative: to here, else to the
    project), refused with the reason when it does not fit ``target``."""
    directory = resolve_path(directory)
    if not (directory / "config.json").is_file():
        raise HeadError(f"method.head={directory}: no config.json there; give the directory of an EAGLE head")
    config = json.loads((directory / "config.json").read_text())
    weights = _read_weights(directory)
    eagle3 = any(k.startswith("midlayer.") for k in weights) or "d2t" in weights
    kind = "an EAGLE-3" if eagle3 else "an EAGLE-1"
    mine = target.config.get_text_config()
    misfit = [f"{key} {config.get(key)} (the target has {getattr(mine, key)})"
              for key in ("hidden_size", "vocab_size") if config.get(key) != getattr(mine, key)]
    if config.get("num_hidden_layers", 1) != 1:
        misfit.append(f"num_hidden_layers {config['num_hidden_layers']} ({kind} head has 1)")
    reads: tuple[int, ...] = ()
    if eagle3:
        reads = _eagle3_reads(config, mine.num_hidden_layers)
        if len(reads) != 3 or not all(0 <= i <= mine.num_hidden_layers for i in reads):
            misfit.append(f"fused layers {list(reads)} (the target has {mine.num_hidden_layers} layers; an "
                          "EAGLE-3 head fuses three)")
    if misfit:
        raise HeadError(f"method.head={directory} was trained for another target: {', '.join(misfit)}")
    weights = {k: v for k, v in weights.items() if k not in ("embed_tokens.weight", "t2d")
               and not (k == "lm_head.weight" and not eagle3)}
    if eagle3:
        rows = weights.get("lm_head.weight")
        size = rows.shape[0] if rows is not None else int(config.get("draft_vocab_size") or mine.vocab_size)
        head = Eagle3Head(target, size, reads)
        if "d2t" not in weights and size == mine.vocab_size:  # a full-vocabulary head ships none (EAGLE drops it)
            weights["d2t"] = torch.zeros(size, dtype=torch.long)
    else:
        head = EagleHead(target, fc_bias="fc.bias" in weights)
    expected = head.state_dict()
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    wrong = sorted(k for k in set(expected) & set(weights) if expected[k].shape != weights[k].shape)
    if missing or unexpected or wrong:
        parts = [f"missing {missing}" if missing else "", f"unexpected {unexpected}" if unexpected else "",
                 "wrong shapes " + ", ".join(f"{k} {tuple(weights[k].shape)} (needs {tuple(expected[k].shape)})"
                                             for k in wrong) if wrong else ""]
        raise HeadError(f"method.head={directory} is {kind} head that does not fit {type(target).__name__}: "
                        + "; ".join(p for p in parts if p))
    if eagle3:
        ids = torch.arange(len(weights["d2t"])) + weights["d2t"].long()
        if int(ids.min()) < 0 or int(ids.max()) >= mine.vocab_size:
            raise HeadError(f"method.head={directory}: d2t maps draft ids outside the target's vocabulary "
                            f"(0..{mine.vocab_size - 1})")
        weights["d2t"] = weights["d2t"].long()
    head.load_state_dict(weights)
    return head.to(device=target.device, dtype=target.dtype)


def load_draft_vocab(directory: str | Path, size: bool | int, vocab_size: int) -> torch.Tensor | None:
    """The target ids an EAGLE-1 head drafts over, most frequent first: all it ships (``size`` True), its
    first ``size``, or None (the whole vocabulary: ``size`` False, or True for a head that ships none)."""
    if size is False:
        return None
    path = resolve_path(directory) / DRAFT_VOCAB_FILE
    if not path.is_file():
        if size is True:
            return None
        raise HeadError(f"method.draft_vocab={size}: the head {directory} ships no {DRAFT_VOCAB_FILE}; "
                        "use method.draft_vocab=false (the whole vocabulary)")
    ids = load_file(str(path)).get("tokens")
    if ids is None or ids.dim() != 1 or len(ids) == 0 or int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise HeadError(f"{path}: 'tokens' must be a non-empty list of target ids below {vocab_size}; "
                        "retrain the head or use method.draft_vocab=false")
    if size is not True:
        if size > len(ids):
            raise HeadError(f"method.draft_vocab={size}: the head {directory} ships {len(ids)} draft tokens; "
                            f"ask for at most {len(ids)}")
        ids = ids[:size]
    return ids.long()
