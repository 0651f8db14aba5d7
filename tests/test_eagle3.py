"""EAGLE-3 checkpoints: a head the test writes in the published layout (midlayer.*, fc over three fused
layers, its own norm and lm_head over a reduced vocabulary, d2t/t2d) loads, drafts what an independent
from-scratch implementation of its equations predicts, is lossless, and is refused with the reason when
it is incomplete or does not fit."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from conftest import VOCAB
from methods.drafter import Drafter
from methods.eagle import Eagle, HeadError
from methods.engine import Engine

HIDDEN, HEADS, KV_HEADS, DRAFT_VOCAB = 32, 4, 2, 24
READS = (2, 4, 5)  # the published (2, L//2, L-3) for L = 8


@pytest.fixture(scope="module")
def target() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=8,
                         num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=512,
                         eos_token_id=None, bos_token_id=None, pad_token_id=None)
    return LlamaForCausalLM(config).eval()


def published_state(seed: int = 1) -> dict[str, torch.Tensor]:
    """The keys and shapes of SafeAILab's EAGLE-3 checkpoints, with random values (norms near 1)."""
    g = torch.Generator().manual_seed(seed)
    hd = HIDDEN // HEADS
    shapes = {
        "fc.weight": (HIDDEN, 3 * HIDDEN),
        "midlayer.self_attn.q_proj.weight": (HEADS * hd, 2 * HIDDEN),
        "midlayer.self_attn.k_proj.weight": (KV_HEADS * hd, 2 * HIDDEN),
        "midlayer.self_attn.v_proj.weight": (KV_HEADS * hd, 2 * HIDDEN),
        "midlayer.self_attn.o_proj.weight": (HIDDEN, HEADS * hd),
        "midlayer.mlp.gate_proj.weight": (64, HIDDEN),
        "midlayer.mlp.up_proj.weight": (64, HIDDEN),
        "midlayer.mlp.down_proj.weight": (HIDDEN, 64),
        "lm_head.weight": (DRAFT_VOCAB, HIDDEN),
    }
    state = {k: torch.randn(s, generator=g) * 0.3 for k, s in shapes.items()}
    for norm in ("midlayer.hidden_norm.weight", "midlayer.input_layernorm.weight",
                 "midlayer.post_attention_layernorm.weight", "norm.weight"):
        state[norm] = 1 + 0.2 * torch.randn(HIDDEN, generator=g)
    used = sorted(random.Random(seed).sample(range(VOCAB), DRAFT_VOCAB))  # the draft vocabulary, by id
    state["d2t"] = torch.tensor(used) - torch.arange(DRAFT_VOCAB)
    state["t2d"] = torch.zeros(VOCAB, dtype=torch.bool)
    state["t2d"][used] = True
    return state


def write_head(directory, state, config_updates=None):
    directory.mkdir()
    config = {"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": HIDDEN, "intermediate_size": 64,
              "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "num_hidden_layers": 1,
              "vocab_size": VOCAB, "draft_vocab_size": DRAFT_VOCAB, "rms_norm_eps": 1e-6} | (config_updates or {})
    (directory / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in state.items()}, str(directory / "model.safetensors"))
    return str(directory)


def _rms(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


@torch.no_grad()
def chain_from_scratch(model, w, ids: list[int], steps: int) -> list[int]:
    """The greedy chain of the EAGLE-3 equations, written out: fused features, the midlayer over
    [norm(embedding), norm(feature)] with the residual from the un-normed feature, norm + lm_head, d2t."""
    hs = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
    states = list(torch.cat([hs[i][0] for i in READS], -1)[:-1] @ w["fc.weight"].T)  # fused, then fc
    tokens = list(ids[1:])
    rotary = model.model.rotary_emb
    embed = model.get_input_embeddings()
    chain = []
    hd = HIDDEN // HEADS
    for _ in range(steps):
        q_len = len(tokens)
        h = torch.stack(states)  # [q, h]
        e = embed(torch.tensor(tokens))
        x = torch.cat([_rms(e, w["midlayer.input_layernorm.weight"]), _rms(h, w["midlayer.hidden_norm.weight"])], -1)
        q = (x @ w["midlayer.self_attn.q_proj.weight"].T).view(q_len, HEADS, hd).transpose(0, 1)
        k = (x @ w["midlayer.self_attn.k_proj.weight"].T).view(q_len, KV_HEADS, hd).transpose(0, 1)
        v = (x @ w["midlayer.self_attn.v_proj.weight"].T).view(q_len, KV_HEADS, hd).transpose(0, 1)
        cos, sin = rotary(x[None], torch.arange(q_len)[None])
        q, k = apply_rotary_pos_emb(q[None], k[None], cos, sin)
        k, v = k[0].repeat_interleave(HEADS // KV_HEADS, 0), v.repeat_interleave(HEADS // KV_HEADS, 0)
        scores = q[0] @ k.transpose(1, 2) / math.sqrt(hd)
        scores = scores.masked_fill(~torch.ones(q_len, q_len, dtype=torch.bool).tril(), float("-inf"))
        attended = (scores.softmax(-1) @ v).transpose(0, 1).reshape(q_len, HIDDEN)
        attended = attended @ w["midlayer.self_attn.o_proj.weight"].T
        h = h + attended
        m = _rms(h, w["midlayer.post_attention_layernorm.weight"])
        h = h + (F.silu(m @ w["midlayer.mlp.gate_proj.weight"].T) * (m @ w["midlayer.mlp.up_proj.weight"].T)) @ w[
            "midlayer.mlp.down_proj.weight"].T
        draft = int((_rms(h[-1], w["norm.weight"]) @ w["lm_head.weight"].T).argmax())
        token = draft + int(w["d2t"][draft])
        chain.append(token)
        states, tokens = states + [h[-1]], tokens + [token]
    return chain


def run(model, drafter, prompt, n):
    return Engine(model, set()).generate(prompt, drafter, n).output_ids


def test_a_published_eagle3_head_drafts_what_its_equations_predict(target, tmp_path):
    state = published_state()
    head = write_head(tmp_path / "eagle3", state)
    drafter = Eagle(VOCAB, head=head, total_tokens=5, depth=4, top_k=1)  # a greedy chain of four
    prompt = [3, 14, 15, 9, 26, 5]
    ids = prompt + run(target, drafter, prompt, 9)
    assert drafter.hidden_layers == READS and drafter.describe()["draft_vocab"] == DRAFT_VOCAB
    draft = drafter.propose(ids)
    assert draft.shape.is_chain and draft.tokens.tolist() == chain_from_scratch(target, state, ids, 4)
    used = set((torch.arange(DRAFT_VOCAB) + state["d2t"]).tolist())
    assert set(draft.tokens.tolist()) <= used


@pytest.mark.parametrize("kwargs", [{"total_tokens": 12, "depth": 4, "top_k": 3}, {"tree": "paper-b3"}],
                         ids=["dynamic", "static"])
def test_an_eagle3_head_is_lossless(target, tmp_path, kwargs):
    drafter = Eagle(VOCAB, head=write_head(tmp_path / "eagle3", published_state()), **kwargs)
    rng = random.Random("eagle3")
    for _ in range(4):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 20))]
        n = rng.randint(1, 30)
        assert run(target, drafter, prompt, n) == run(target, Drafter(VOCAB), prompt, n), prompt


def test_the_fused_layers_come_from_the_config_when_it_names_them(target, tmp_path):
    head = write_head(tmp_path / "eagle3", published_state(),
                      {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 7]}})
    drafter = Eagle(VOCAB, head=head, total_tokens=4, depth=2, top_k=2)
    drafter.attach(target)
    assert drafter.hidden_layers == (1, 3, 7)


def _without(key):
    state = published_state()
    del state[key]
    return state


@pytest.mark.parametrize("state, updates, message", [
    (_without("midlayer.hidden_norm.weight"), None,
     r"EAGLE-3 head that does not fit .*missing \['midlayer.hidden_norm.weight'\]"),
    (_without("d2t"), None, r"missing \['d2t'\]"),
    (published_state(), {"hidden_size": 64}, "another target: hidden_size 64"),
    (published_state(), {"eagle_aux_hidden_state_layer_ids": [2, 4, 9]}, r"fused layers \[2, 4, 9\]"),
    ({**published_state(), "d2t": published_state()["d2t"] + VOCAB}, None, "d2t maps draft ids outside"),
    ({**published_state(), "fc.weight": torch.zeros(HIDDEN, 2 * HIDDEN)}, None, r"wrong shapes fc.weight \(32, 64\)"),
])
def test_a_wrong_or_misfit_eagle3_head_is_refused_with_the_reason(target, tmp_path, state, updates, message):
    head = write_head(tmp_path / "eagle3", state, updates)
    with pytest.raises(HeadError, match=message):
        Eagle(VOCAB, head=head).attach(target)


def test_an_eagle3_head_keeps_its_own_vocabulary(target, tmp_path):
    head = write_head(tmp_path / "eagle3", published_state())
    with pytest.raises(HeadError, match="ships no draft_vocab"):
        Eagle(VOCAB, head=head, draft_vocab=8).attach(target)
    with pytest.raises(HeadError, match="Llama-style decoder layer"):
        from conftest import tiny_gemma3

        Eagle(VOCAB, head=head).attach(tiny_gemma3())
