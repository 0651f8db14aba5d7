"""Test helpers: configs composed exactly as `python -m evaluation.run` composes them, a tiny checkpoint
(evaluation.tiny)."""

from __future__ import annotations

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from evaluation.tiny import tiny_checkpoint  # noqa: F401 -- the tests import it from here
from methods.paths import PROJECT_ROOT

CONF = PROJECT_ROOT / "conf"


def config(*overrides: str, name: str = "config") -> DictConfig:
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        return compose(name, overrides=list(overrides))


def method_names() -> list[str]:
    return sorted(p.stem for p in (CONF / "method").glob("*.yaml"))
