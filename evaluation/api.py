"""Decode with any method from Python, without Hydra's command line: the harness's own engine and drafters.

    from evaluation.api import generate, load
    model, tokenizer = load("smollm2-135m")
    out = generate(model, tokenizer, "List three uses of a paperclip.", method="recycling", max_new_tokens=48)
    print(out.text, out.mat)

``method`` and its settings are those of ``conf/method/<method>.yaml`` (``method="sam", mode="merge"``,
``method="recycling", tree="paper-b4"``; ``tree="auto"`` where this machine has a calibration and statistics,
see ``docs/choosing-trees.md``). The model is any Hugging Face causal LM already in memory; ``model_name`` names a
``conf/model/*.yaml`` entry for its chat template, stop tokens, shipped EAGLE head and the key of its calibration
(default: the name :func:`load` gave it, else ``hf``: the tokenizer's own chat template).

Sampling: ``temperature=0.7, top_p=0.9, seed=1`` (and ``top_k``) as the benchmark's ``sampling.*`` keys
(docs/sampling.md); every method's answer then equals the baseline's for the same prompt and seed. ``seed`` is the
sampling noise's (a method's own ``seed`` setting, Lookahead's and a random EAGLE head's, keeps its default here).

:func:`generate` builds a fresh drafter per call; a :class:`Decoder` keeps one across calls, so that hot-start
state (Token Recycling's matrix) carries from one prompt to the next, as in a benchmark run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, OmegaConf, open_dict
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from evaluation import models
from evaluation.build import build
from evaluation.run import run_label
from methods.paths import PROJECT_ROOT

_NAME = "draftbench_model"  # the attribute load() leaves on a model: its conf/model/ entry


@dataclass
class Output:
    """One generation: the answer and how it was decoded."""

    text: str
    ids: list[int]  # new token ids (the stop token included when one ended the answer)
    accept_lengths: list[int]  # tokens emitted per decode forward, bonus included
    prefill_time: float  # seconds
    decode_time: float  # seconds
    method: str  # the method's label, as a result file names it

    @property
    def mat(self) -> float:
        """Mean accepted tokens per decode forward (bonus included); 1.0 for greedy decoding."""
        return sum(self.accept_lengths) / len(self.accept_lengths) if self.accept_lengths else float("nan")

    @property
    def tokens_per_s(self) -> float:
        return len(self.ids) / (self.prefill_time + self.decode_time)


def load(name: str = "smollm2-135m", device: str = "auto", dtype: str = "auto"
         ) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A model of ``conf/model/`` (``smollm2-135m``: the embedded one, offline) and its tokenizer."""
    cfg = _config(name, "baseline", device, dtype)
    dev = models.resolve_device(cfg.device)
    loaded = models.load(cfg.model, dev, models.resolve_dtype(cfg.dtype, dev, cfg.model))
    setattr(loaded.model, _NAME, name)
    return loaded.model, loaded.tokenizer


class Decoder:
    """One method on one model, ready to answer prompt after prompt with its hot-start state kept."""

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, method: str = "baseline",
                 model_name: str | None = None, *, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                 seed: int = 0, **settings: Any):
        name = model_name or getattr(model, _NAME, None) or "hf"
        dtype = str(model.dtype).removeprefix("torch.")
        sampling = {"temperature": temperature, "top_k": top_k, "top_p": top_p, "seed": seed}
        self.cfg = _config(name, method, str(model.device), dtype, settings, sampling)
        eos = models.stop_token_ids(tokenizer, model.generation_config, self.cfg.model.get("stop_tokens") or [])
        loaded = models.LoadedModel(model=model, tokenizer=tokenizer, eos_token_ids=eos, source="in memory")
        self.built = build(self.cfg, [], loaded)
        self.template = self.cfg.model.template if name != "hf" or tokenizer.chat_template else "plain"

    def generate(self, prompt: str | list[dict[str, str]], max_new_tokens: int = 128) -> Output:
        """Answer ``prompt`` (a user message, or a conversation ending in one)."""
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        tokenizer = self.built.loaded.tokenizer
        gen = self.built.engine.generate(models.prompt_ids(tokenizer, self.template, messages), self.built.drafter,
                                         max_new_tokens)
        return Output(text=tokenizer.decode(gen.output_ids, skip_special_tokens=True), ids=gen.output_ids,
                      accept_lengths=gen.accept_lengths, prefill_time=gen.prefill_time, decode_time=gen.decode_time,
                      method=run_label(self.cfg))


def generate(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, prompt: str | list[dict[str, str]],
             method: str = "baseline", max_new_tokens: int = 128, model_name: str | None = None, *,
             temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
             **settings: Any) -> Output:
    """Answer ``prompt`` with ``method`` (a name of ``conf/method/``) and its ``settings``; a fresh drafter.
    ``temperature`` 0 decodes greedily; above 0 it samples (with ``top_k``, ``top_p``), keyed by ``seed``."""
    return Decoder(model, tokenizer, method, model_name, temperature=temperature, top_k=top_k, top_p=top_p,
                   seed=seed, **settings).generate(prompt, max_new_tokens)


def _config(model: str, method: str, device: str, dtype: str, settings: dict | None = None,
            sampling: dict | None = None) -> DictConfig:
    """The run config the command line would compose for these choices, with ``settings`` set on the method and
    ``sampling`` on ``sampling``."""
    known = sorted(p.stem for p in (PROJECT_ROOT / "conf" / "method").glob("*.yaml"))
    if method not in known:
        raise ValueError(f"method={method!r} is not one of {', '.join(known)} (conf/method/)")
    models_known = sorted(p.stem for p in (PROJECT_ROOT / "conf" / "model").glob("*.yaml"))
    if model not in models_known:
        raise ValueError(f"model_name={model!r} is not one of {', '.join(models_known)} (conf/model/)")
    overrides = [f"model={model}", f"method={method}", f"device={device}", f"dtype={dtype}", "run.progress=false"]
    if model == "hf":
        overrides.append("model.path=in-memory")
    with initialize_config_dir(config_dir=str(PROJECT_ROOT / "conf"), version_base=None):
        cfg = compose("config", overrides=overrides)
    for key, value in (settings or {}).items():
        if key not in cfg.method or key in ("_target_", "name", "label"):
            raise ValueError(f"method {method!r} has no setting {key!r}; its settings are "
                             f"{', '.join(k for k in cfg.method if k not in ('_target_', 'name', 'label'))} "
                             f"(conf/method/{method}.yaml)")
        with open_dict(cfg):
            cfg.method[key] = value
    cfg.sampling.update(sampling or {})
    OmegaConf.resolve(cfg)  # the label and device-dependent defaults, with the settings in
    if cfg.threads:
        torch.set_num_threads(int(cfg.threads))
    return cfg
