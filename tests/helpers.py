"""Composing draftbench configs in tests, exactly as `python -m evaluation.run` would."""

from __future__ import annotations

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from evaluation.data import PROJECT_ROOT

CONF = PROJECT_ROOT / "conf"


def config(*overrides: str) -> DictConfig:
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        return compose("config", overrides=list(overrides))


def method_names() -> list[str]:
    return sorted(p.stem for p in (CONF / "method").glob("*.yaml"))
