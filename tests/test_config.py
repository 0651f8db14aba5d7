"""Every config composes and every method instantiates, cheaply (no model is loaded)."""

import pytest
from hydra.errors import ConfigCompositionException

from evaluation.build import build_drafter
from helpers import CONF, config, method_names
from methods.drafter import Drafter


@pytest.mark.parametrize("method", method_names())
def test_every_method_instantiates(method):
    cfg = config(f"method={method}")
    drafter = build_drafter(cfg.method, vocab_size=64, device="cpu")
    assert isinstance(drafter, Drafter)
    assert cfg.method.name == method and cfg.method.label


@pytest.mark.parametrize("model", sorted(p.stem for p in (CONF / "model").glob("*.yaml")))
def test_every_model_config_composes(model):
    cfg = config(f"model={model}", "model.path=/some/checkpoint" if model == "hf" else "max_new_tokens=8")
    assert cfg.model.name and cfg.model.template


@pytest.mark.parametrize("data", sorted(p.stem for p in (CONF / "data").glob("*.yaml")))
def test_every_data_config_composes(data):
    assert config(f"data={data}", "data.limit=3").data.limit == 3


def test_recycling_overrides_and_label():
    cfg = config("method=recycling", "method.tree=paper-b4", "method.k=4", "method.start=cold")
    assert cfg.method.label == "recycling-paper-b4-k4-cold"
    drafter = build_drafter(cfg.method, vocab_size=64, device="cpu")
    assert drafter.k == 4 and drafter.start == "cold" and drafter.shape().n_nodes == 16


@pytest.mark.parametrize("device, tree", [("cpu", "paper-b2"), ("cuda", "dynamic"), ("cuda:1", "dynamic")])
def test_eagle_defaults_to_the_tree_measured_best_for_the_device(device, tree):
    cfg = config("method=eagle", f"device={device}")
    assert cfg.method.tree == tree and cfg.method.label.startswith(f"eagle-{tree}-")
    assert config("method=eagle", f"device={device}", "method.tree=paper-b3").method.tree == "paper-b3"


def test_unknown_method_lists_the_choices():
    with pytest.raises(ConfigCompositionException, match="baseline"):
        config("method=nope")


def test_a_typo_in_a_method_key_fails_at_composition():
    with pytest.raises(ConfigCompositionException):
        config("method=recycling", "method.treee=paper")
