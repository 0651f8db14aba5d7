"""From a config to what decodes: the model, the engine and the method's drafter (with its ``=auto`` plans).

``evaluation.run``, ``evaluation.interleave``, ``evaluation.calibrate``, ``evaluation.acceptance`` and the Python
API all build through here, so a method runs the same wherever it is started.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig

from evaluation import autotree, models
from methods.drafter import Drafter
from methods.engine import Engine
from methods.sampling import Sampling


def build_drafter(method: DictConfig, vocab_size: int, device: torch.device | str, **overrides: object) -> Drafter:
    """The drafter a method config names (``_target_``); ``name``/``label`` are the harness's own keys.

    ``overrides`` are constructor arguments that are objects, not config (a TreePlan), so they are
    passed to the class, not through the config.
    """
    params = {k: v for k, v in method.items() if k not in ("name", "label", *overrides)}
    return instantiate(params, _convert_="all", _partial_=True)(vocab_size=vocab_size, device=device, **overrides)


@dataclass
class Built:
    """A method ready to decode: the loaded model, the engine over it and the method's drafter."""

    loaded: models.LoadedModel
    engine: Engine
    drafter: Drafter
    device: torch.device
    dtype: torch.dtype
    padding: dict  # what the run header records of the engine's block padding

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")


def build(cfg: DictConfig, questions: list[dict], loaded: models.LoadedModel | None = None) -> Built:
    """Resolve ``cfg``'s device and dtype, its ``=auto`` plans (their files are checked before the model loads, so
    a missing one fails fast), load the model (or reuse ``loaded``) and build the engine and the drafter.
    ``questions``: the ones to be evaluated (statistics collected on any of them are refused)."""
    rule = Sampling.of(cfg.get("sampling"))  # bad settings fail before the model loads
    device = models.resolve_device(cfg.device)
    dtype = models.resolve_dtype(cfg.dtype, device, cfg.model)
    padding, padding_facts = autotree.padding(cfg, device, dtype)
    plans = autotree.resolve(cfg, device, dtype, questions, padded=padding is not None)
    loaded = loaded or models.load(cfg.model, device, dtype)
    vocab_size = loaded.model.get_output_embeddings().weight.shape[0]
    drafter = build_drafter(cfg.method, vocab_size, device, **plans)
    drafter.attach(loaded.model)  # a drafter that does not fit the model (e.g. a draft head) fails here
    time_forward = device.type == "cpu" if cfg.time_forward == "auto" else bool(cfg.time_forward)
    engine = Engine(loaded.model, loaded.eos_token_ids, time_forward=time_forward, padding=padding,
                    sampling=rule)
    return Built(loaded, engine, drafter, device, dtype, padding_facts)
