"""The EAGLE-1 draft head (Li et al., 2024): one decoder layer of the target's own type that predicts the
target's next last-layer feature from the current feature and the next token's embedding.

``fc`` maps ``[embedding of token t+1, target feature at t]`` (2h) to h, one decoder layer built from the
target's own layer class (layer 0 without its input norm, as published) turns that into the predicted
feature at t+1, and the target's frozen lm_head reads it. The embeddings and the lm_head are the target's
(tied or not); the head owns only ``fc`` and the layer, with the published state-dict keys (``fc.weight``,
``fc.bias``, ``layers.0.*``), so a published EAGLE-1 checkpoint loads as it is and ours is saved the same way.
"""

from __future__ import annotations

import copy
import inspect
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import PreTrainedModel, PretrainedConfig

from methods.drafter import DrafterUnfit

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


class HeadError(DrafterUnfit):
    """A draft head that cannot be loaded or does not fit the target; the message says what to do."""


def head_config(target: PretrainedConfig) -> PretrainedConfig:
    """The target's text config with one decoder layer: the head's layer is the target's layer type."""
    config = copy.deepcopy(target.get_text_config())
    config.num_hidden_layers = 1
    if getattr(config, "layer_types", None):
        config.layer_types = ["full_attention"]
    return config


class EagleHead(nn.Module):
    """``fc`` + one decoder layer of the target's type; call it with the target's embedding and lm_head."""

    def __init__(self, target: PreTrainedModel, fc_bias: bool = True):
        super().__init__()
        base = target.base_model
        if not hasattr(base, "layers") or not hasattr(base, "rotary_emb"):
            raise HeadError(f"an EAGLE head copies the target's decoder layer and rotary embedding; "
                            f"{type(target).__name__} has no base_model.layers / rotary_emb")
        self.config = head_config(target.config)
        hidden = self.config.hidden_size
        self.fc = nn.Linear(2 * hidden, hidden, bias=fc_bias)
        layer = type(base.layers[0])(self.config, layer_idx=0)
        layer.input_layernorm = nn.Identity()  # layer 0 has no input norm (EAGLE's cnets1.py)
        self.layers = nn.ModuleList([layer])
        self.rotary = type(base.rotary_emb)(config=self.config)
        params = inspect.signature(type(layer).forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        # Gemma3-style rotary embeddings are per layer type; the head's one layer attends globally
        rotary_params = inspect.signature(type(self.rotary).forward).parameters
        self._rotary_args = ("full_attention",) if "layer_type" in rotary_params else ()
        self.to(device=target.device, dtype=target.dtype)

    def forward(self, embeds: torch.Tensor, features: torch.Tensor, position_ids: torch.Tensor,
                mask: torch.Tensor | None, cache) -> torch.Tensor:
        """Predicted next features [1, q, h] of ``embeds`` and ``features`` [1, q, h] at ``position_ids`` [1, q];
        ``mask`` is an additive [1, 1, q, cached + q] mask (None: one query that sees everything)."""
        x = self.fc(torch.cat([embeds, features], -1))
        return self.layers[0](x, attention_mask=mask, position_ids=position_ids, use_cache=True,
                              position_embeddings=self.rotary(x, position_ids, *self._rotary_args),
                              **{self._cache_kw: cache})

    def save(self, directory: str | Path, metrics: dict | None = None) -> None:
        """The published EAGLE-1 layout: ``config.json`` (the target's config, one layer, ``bias``) and
        ``model.safetensors``; ``metrics`` (training figures) go to ``metrics.json`` beside them."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        config = self.config.to_dict() | {"bias": self.fc.bias is not None}
        (directory / "config.json").write_text(json.dumps(config, indent=1, default=str))
        save_file({k: v.contiguous() for k, v in self.state_dict().items()}, str(directory / "model.safetensors"))
        if metrics is not None:
            (directory / "metrics.json").write_text(json.dumps(metrics, indent=1))


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
                    "EAGLE-1 head (config.json + weights), or train one (make train-eagle)")


def load_head(directory: str | Path, target: PreTrainedModel) -> EagleHead:
    """An EAGLE-1 head from a checkpoint directory, refused with the reason when it does not fit ``target``."""
    directory = Path(directory).expanduser()
    if not (directory / "config.json").is_file():
        raise HeadError(f"method.head={directory}: no config.json there; give the directory of an EAGLE-1 head")
    config = json.loads((directory / "config.json").read_text())
    weights = _read_weights(directory)
    if any(k.startswith("midlayer.") for k in weights) or "d2t" in weights:
        raise HeadError(f"method.head={directory} is an EAGLE-3 head (midlayer.*, d2t); draftbench loads EAGLE-1 "
                        "heads (fc.weight, layers.0.*)")
    mine = target.config.get_text_config()
    misfit = [f"{key} {config.get(key)} (the target has {getattr(mine, key)})"
              for key in ("hidden_size", "vocab_size") if config.get(key) != getattr(mine, key)]
    if config.get("num_hidden_layers", 1) != 1:
        misfit.append(f"num_hidden_layers {config['num_hidden_layers']} (an EAGLE-1 head has 1)")
    if misfit:
        raise HeadError(f"method.head={directory} was trained for another target: {', '.join(misfit)}")
    weights = {k: v for k, v in weights.items() if k not in ("embed_tokens.weight", "lm_head.weight")}
    head = EagleHead(target, fc_bias="fc.bias" in weights)
    expected = head.state_dict()
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    wrong = sorted(k for k in set(expected) & set(weights) if expected[k].shape != weights[k].shape)
    if missing or unexpected or wrong:
        parts = [f"missing {missing}" if missing else "", f"unexpected {unexpected}" if unexpected else "",
                 "wrong shapes " + ", ".join(f"{k} {tuple(weights[k].shape)} (needs {tuple(expected[k].shape)})"
                                             for k in wrong) if wrong else ""]
        raise HeadError(f"method.head={directory} does not fit {type(target).__name__}: "
                        + "; ".join(p for p in parts if p))
    head.load_state_dict(weights)
    return head.to(device=target.device, dtype=target.dtype)
