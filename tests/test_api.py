"""The Python API: any method on a model the user holds, the same engine and drafters as the harness."""

from __future__ import annotations

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from evaluation import models
from evaluation.api import Decoder, generate
from helpers import tiny_checkpoint

PROMPT = "a b c d e f g a b c d e f g a b c"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tiny_checkpoint(tmp_path_factory.mktemp("api"))
    return AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)


@pytest.mark.parametrize("method, settings", [
    ("recycling", {}), ("recycling", {"tree": "paper-b4", "start": "cold"}), ("pld", {"num_pred_tokens": 4}),
    ("lookahead", {}), ("sam", {"mode": "merge"}), ("sam", {"aux": "none"}),
    ("eagle", {"head": "random", "tree": "dynamic", "total_tokens": 8, "depth": 3, "top_k": 2}),
])
def test_every_method_answers_as_greedy_decoding(tiny, method, settings):
    model, tokenizer = tiny
    greedy = generate(model, tokenizer, PROMPT, max_new_tokens=24)
    out = generate(model, tokenizer, PROMPT, method=method, max_new_tokens=24, **settings)
    assert out.ids == greedy.ids and out.text == greedy.text
    assert greedy.mat == 1.0 and sum(out.accept_lengths) == len(out.ids) - 1  # the first token comes from the prefill
    assert out.method.startswith(method)


def test_a_setting_the_method_does_not_have_is_refused_with_its_settings(tiny):
    model, tokenizer = tiny
    with pytest.raises(ValueError, match=r"method 'sam' has no setting 'modes'; its settings are .*mode"):
        generate(model, tokenizer, PROMPT, method="sam", modes="merge")
    with pytest.raises(ValueError, match="method='medusa' is not one of .*recycling"):
        generate(model, tokenizer, PROMPT, method="medusa")


def test_a_decoder_keeps_hot_start_state_across_prompts(tiny):
    model, tokenizer = tiny
    decoder = Decoder(model, tokenizer, "recycling", tree="paper-b4")
    decoder.generate(PROMPT, max_new_tokens=24)
    again = decoder.generate(PROMPT, max_new_tokens=24)
    fresh = generate(model, tokenizer, PROMPT, method="recycling", tree="paper-b4", max_new_tokens=24)
    assert again.ids == fresh.ids
    assert again.mat > fresh.mat  # the matrix learnt this prompt's continuations on the first call


def test_a_conversation_is_answered_in_the_model_template(tiny):
    model, tokenizer = tiny
    turns = [{"role": "user", "content": "a b c"}, {"role": "assistant", "content": "d e"}, {"role": "user", "content": "f"}]
    decoder = Decoder(model, tokenizer)  # a tokenizer without a chat template: Question:/Answer: turns
    out = decoder.generate(turns, max_new_tokens=8)
    prompt = models.prompt_ids(tokenizer, "plain", turns)
    assert decoder.template == "plain"
    assert out.ids == decoder.built.engine.generate(prompt, decoder.built.drafter, 8).output_ids
