"""The full list of hook names is part of lucidlm's public interface (TransformerLens pins
its cache keys the same way): renaming or dropping one breaks users' analysis code, so
every name, in forward-pass order, and every activation's shape are written out here."""

import pytest
import torch

from lucidlm import Transformer, preset
from lucidlm.inspect import run_with_cache

B, T = 2, 5

# Sizes are shrunk so that no two of d, nh * hd, d_mlp, nh, nkv coincide by accident.
FAMILIES = {
    "gpt2": dict(vocab_size=97, d_model=24, n_layers=1, n_heads=4, head_dim=8, max_seq_len=16),
    "llama": dict(vocab_size=97, d_model=24, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=8, d_mlp=40,
                  max_seq_len=16),
    "smollm2-135m": dict(vocab_size=97, d_model=24, n_layers=1, n_heads=3, n_kv_heads=1, head_dim=6, d_mlp=40,
                         max_seq_len=16),
    "seed000": dict(vocab_size=97, d_model=24, n_layers=1, n_heads=4, head_dim=8, d_mlp=40, max_seq_len=16),
    "seed004-words": dict(vocab_size=97, d_model=24, n_layers=1, n_heads=4, head_dim=8, d_mlp=40, max_seq_len=16),
    "shakespeare-char": dict(vocab_size=97, d_model=24, n_layers=1, n_heads=4, head_dim=8, max_seq_len=16),
}

# Pre-norm GPT-2 family: learned positions, LayerNorm, 2-matrix GELU MLP.
GPT2_NAMES = [
    "hook_embed",
    "hook_pos_embed",
    "blocks.0.hook_resid_pre",
    "blocks.0.ln1.hook_scale",
    "blocks.0.ln1.hook_normalized",
    "blocks.0.attn.hook_q",
    "blocks.0.attn.hook_k",
    "blocks.0.attn.hook_v",
    "blocks.0.attn.hook_attn_scores",
    "blocks.0.attn.hook_pattern",
    "blocks.0.attn.hook_z",
    "blocks.0.hook_attn_out",
    "blocks.0.hook_resid_mid",
    "blocks.0.ln2.hook_scale",
    "blocks.0.ln2.hook_normalized",
    "blocks.0.mlp.hook_pre",
    "blocks.0.mlp.hook_post",
    "blocks.0.hook_mlp_out",
    "blocks.0.hook_resid_post",
    "ln_final.hook_scale",
    "ln_final.hook_normalized",
]

# Pre-norm LLaMA family: RoPE (rotated q/k hooked separately), RMSNorm, SwiGLU.
LLAMA_NAMES = [
    "hook_embed",
    "blocks.0.hook_resid_pre",
    "blocks.0.ln1.hook_scale",
    "blocks.0.ln1.hook_normalized",
    "blocks.0.attn.hook_q",
    "blocks.0.attn.hook_k",
    "blocks.0.attn.hook_v",
    "blocks.0.attn.hook_rot_q",
    "blocks.0.attn.hook_rot_k",
    "blocks.0.attn.hook_attn_scores",
    "blocks.0.attn.hook_pattern",
    "blocks.0.attn.hook_z",
    "blocks.0.hook_attn_out",
    "blocks.0.hook_resid_mid",
    "blocks.0.ln2.hook_scale",
    "blocks.0.ln2.hook_normalized",
    "blocks.0.mlp.hook_pre",
    "blocks.0.mlp.hook_pre_linear",
    "blocks.0.mlp.hook_post",
    "blocks.0.hook_mlp_out",
    "blocks.0.hook_resid_post",
    "ln_final.hook_scale",
    "ln_final.hook_normalized",
]

# Seed 000: post-norm ("x = norm(x + attn(x))"), RoPE, RMSNorm, ReLU MLP, no final norm.
SEED000_NAMES = [
    "hook_embed",
    "blocks.0.hook_resid_pre",
    "blocks.0.attn.hook_q",
    "blocks.0.attn.hook_k",
    "blocks.0.attn.hook_v",
    "blocks.0.attn.hook_rot_q",
    "blocks.0.attn.hook_rot_k",
    "blocks.0.attn.hook_attn_scores",
    "blocks.0.attn.hook_pattern",
    "blocks.0.attn.hook_z",
    "blocks.0.hook_attn_out",
    "blocks.0.ln1.hook_scale",
    "blocks.0.ln1.hook_normalized",
    "blocks.0.hook_resid_mid",
    "blocks.0.mlp.hook_pre",
    "blocks.0.mlp.hook_post",
    "blocks.0.hook_mlp_out",
    "blocks.0.ln2.hook_scale",
    "blocks.0.ln2.hook_normalized",
    "blocks.0.hook_resid_post",
]

# Seed 004: add & norm (post-LayerNorm), sinusoidal positions, GELU MLP, no final norm.
SEED004_NAMES = [
    "hook_embed",
    "hook_pos_embed",
    "blocks.0.hook_resid_pre",
    "blocks.0.attn.hook_q",
    "blocks.0.attn.hook_k",
    "blocks.0.attn.hook_v",
    "blocks.0.attn.hook_attn_scores",
    "blocks.0.attn.hook_pattern",
    "blocks.0.attn.hook_z",
    "blocks.0.hook_attn_out",
    "blocks.0.ln1.hook_scale",
    "blocks.0.ln1.hook_normalized",
    "blocks.0.hook_resid_mid",
    "blocks.0.mlp.hook_pre",
    "blocks.0.mlp.hook_post",
    "blocks.0.hook_mlp_out",
    "blocks.0.ln2.hook_scale",
    "blocks.0.ln2.hook_normalized",
    "blocks.0.hook_resid_post",
]

EXPECTED_NAMES = {
    "gpt2": GPT2_NAMES,
    "shakespeare-char": GPT2_NAMES,
    "llama": LLAMA_NAMES,
    "smollm2-135m": LLAMA_NAMES,
    "seed000": SEED000_NAMES,
    "seed004-words": SEED004_NAMES,
}

# Shapes in terms of the config; names are matched by their last part.
SHAPES = {
    "hook_embed": "B T d", "hook_pos_embed": "B T d",
    "hook_resid_pre": "B T d", "hook_attn_out": "B T d", "hook_resid_mid": "B T d",
    "hook_mlp_out": "B T d", "hook_resid_post": "B T d",
    "hook_scale": "B T 1", "hook_normalized": "B T d",
    "attn.hook_q": "B T nh hd", "attn.hook_k": "B T nkv hd", "attn.hook_v": "B T nkv hd",
    "attn.hook_rot_q": "B T nh hd", "attn.hook_rot_k": "B T nkv hd",
    "attn.hook_attn_scores": "B nh T T", "attn.hook_pattern": "B nh T T", "attn.hook_z": "B T nh hd",
    "mlp.hook_pre": "B T d_mlp", "mlp.hook_pre_linear": "B T d_mlp", "mlp.hook_post": "B T d_mlp",
}


def _expected_shape(name, cfg):
    sizes = {"B": B, "T": T, "1": 1, "d": cfg.d_model, "nh": cfg.n_heads, "nkv": cfg.n_kv_heads,
             "hd": cfg.head_dim, "d_mlp": cfg.d_mlp}
    key = next(k for k in sorted(SHAPES, key=len, reverse=True) if name == k or name.endswith("." + k))
    return tuple(sizes[s] for s in SHAPES[key].split())


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_hook_names_and_shapes_are_pinned(family):
    torch.manual_seed(0)
    cfg = preset(family, **FAMILIES[family])
    model = Transformer(cfg).eval()
    expected = EXPECTED_NAMES[family]

    assert sorted(model.hook_points()) == sorted(expected)
    ids = torch.randint(0, cfg.vocab_size, (B, T))
    _, cache = run_with_cache(model, ids)
    assert list(cache.keys()) == expected  # every hook fired, in forward-pass order
    for name in expected:
        assert tuple(cache[name].shape) == _expected_shape(name, cfg), name


def test_hook_names_repeat_per_layer():
    cfg = preset("llama", **{**FAMILIES["llama"], "n_layers": 3})
    names = list(Transformer(cfg).hook_points())
    per_layer = [n for n in LLAMA_NAMES if n.startswith("blocks.0.")]
    for layer in range(3):
        assert sorted(n for n in names if n.startswith(f"blocks.{layer}.")) == sorted(
            n.replace("blocks.0.", f"blocks.{layer}.") for n in per_layer)
    assert len(names) == 3 * len(per_layer) + 3  # + hook_embed + ln_final's two


# Opt-in hook points (model/hook_options.py), present only while switched on.
OPT_IN_NAMES = {"blocks.0.attn.hook_result": "B T nh d", "blocks.0.hook_q_input": "B T nh d",
                "blocks.0.hook_k_input": "B T nkv d", "blocks.0.hook_v_input": "B T nkv d",
                "blocks.0.hook_mlp_in": "B T d"}


@pytest.mark.parametrize("family", ["gpt2", "llama", "seed004-words"])
def test_opt_in_hook_names_and_shapes(family):
    from lucidlm.model.hook_options import set_hook_options

    torch.manual_seed(0)
    cfg = preset(family, **FAMILIES[family])
    model = Transformer(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (B, T))
    plain = model(ids)
    set_hook_options(model, attn_result=True, split_qkv_input=True, mlp_in=True)
    assert sorted(model.hook_points()) == sorted(EXPECTED_NAMES[family] + list(OPT_IN_NAMES))
    logits, cache = run_with_cache(model, ids)
    torch.testing.assert_close(logits, plain, atol=1e-5, rtol=0)  # observing changes nothing
    sizes = {"B": B, "T": T, "d": cfg.d_model, "nh": cfg.n_heads, "nkv": cfg.n_kv_heads}
    for name, shape in OPT_IN_NAMES.items():
        assert tuple(cache[name].shape) == tuple(sizes[s] for s in shape.split()), name
    set_hook_options(model, attn_result=False, split_qkv_input=False, mlp_in=False)
    assert sorted(model.hook_points()) == sorted(EXPECTED_NAMES[family])
