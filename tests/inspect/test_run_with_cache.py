"""run_with_cache / run_with_hooks: what is cached is what the model computed."""

import copy
import math

import numpy as np
import pytest
import torch

from lucidlm.errors import HookError, InputError
from lucidlm.inspect import run_with_cache, run_with_hooks

TEXT = "Hello, world! Fine day."


def _ids(model, text=TEXT):
    return torch.tensor([model.tokenizer.encode(text)])


def test_patterns_are_causal_softmaxes_of_cached_queries_and_keys(family_model):
    model = family_model
    ids = _ids(model)
    T = ids.shape[1]
    _, cache = run_with_cache(model, ids)
    cfg = model.config
    for layer in range(cfg.n_layers):
        pattern = cache["pattern", layer][0].double().numpy()  # (nh, T, T)
        assert pattern.shape == (cfg.n_heads, T, T)
        assert np.all(np.triu(pattern, k=1) == 0.0)  # the future is masked exactly
        np.testing.assert_allclose(pattern.sum(-1), 1.0, atol=1e-6)
        # Recompute softmax(q k^T / sqrt(hd)) in NumPy from the cached (rotated) q and k.
        rope = cfg.positions == "rope"
        q = cache[f"blocks.{layer}.attn.hook_{'rot_q' if rope else 'q'}"][0].double().numpy()  # (T, nh, hd)
        k = cache[f"blocks.{layer}.attn.hook_{'rot_k' if rope else 'k'}"][0].double().numpy()  # (T, nkv, hd)
        k = np.repeat(k, cfg.n_heads // cfg.n_kv_heads, axis=1)
        scores = np.einsum("qhd,khd->hqk", q, k) / math.sqrt(cfg.head_dim)
        scores = np.where(np.tril(np.ones((T, T), bool)), scores, -np.inf)
        expected = np.exp(scores - scores.max(-1, keepdims=True))
        expected /= expected.sum(-1, keepdims=True)
        np.testing.assert_allclose(pattern, expected, atol=1e-5)
        assert pattern.max() > 0.5  # not uniform: the check above has something to check


def test_last_resid_post_through_final_norm_and_unembed_gives_logits(family_model):
    model = family_model
    logits, cache = run_with_cache(model, _ids(model))
    resid = cache["resid_post", -1]  # (1, T, d)
    if model.ln_final is not None:
        resid = model.ln_final(resid)
    expected = resid @ model.unembed.weight.T
    if model.unembed.bias is not None:
        expected = expected + model.unembed.bias
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["llama", "gpt2", "seed004-words"])
def test_kv_cache_prefill_and_decode_cache_the_same_activations_as_a_full_forward(make_model, family):
    model = make_model(family)
    ids = _ids(model)
    T = ids.shape[1] - 1
    full_logits, full = run_with_cache(model, ids)

    model.setup_kv_cache(1, 32)
    try:
        _, prefill = run_with_cache(model, ids[:, :T], input_pos=torch.arange(T))
        step_logits, step = run_with_cache(model, ids[:, T:], input_pos=torch.tensor([T]))
    finally:
        model.clear_kv_cache()

    assert list(step.keys()) == list(full.keys())
    torch.testing.assert_close(step_logits[:, -1], full_logits[:, T], atol=1e-5, rtol=1e-5)
    for name in full:
        if name.endswith(("hook_attn_scores", "hook_pattern")):  # (B, nh, T, S): queries on dim 2
            # With a cache, attention spans all 32 slots; the unwritten ones are masked out.
            assert step[name].shape[-1] == prefill[name].shape[-1] == 32, name
            unseen = float("-inf") if name.endswith("scores") else 0.0
            assert (step[name][..., T + 1:] == unseen).all() and (prefill[name][..., T:] == unseen).all(), name
            torch.testing.assert_close(step[name][..., :T + 1], full[name][:, :, T:], atol=1e-5, rtol=1e-5, msg=name)
            torch.testing.assert_close(prefill[name][..., :T], full[name][:, :, :T, :T], atol=1e-5, rtol=1e-5,
                                       msg=name)
        else:
            torch.testing.assert_close(step[name], full[name][:, T:], atol=1e-5, rtol=1e-5, msg=name)
            torch.testing.assert_close(prefill[name], full[name][:, :T], atol=1e-5, rtol=1e-5, msg=name)


def test_names_filter_forms(tiny_model):
    model = tiny_model
    ids = _ids(model)
    everything = list(model.hook_points())
    assert sorted(run_with_cache(model, ids)[1]) == sorted(everything)
    assert list(run_with_cache(model, ids, names_filter="blocks.1.hook_resid_post")[1]) == ["blocks.1.hook_resid_post"]
    two = ["blocks.0.attn.hook_z", "hook_embed"]
    assert sorted(run_with_cache(model, ids, names_filter=two)[1]) == sorted(two)
    _, patterns = run_with_cache(model, ids, names_filter=lambda n: n.endswith("hook_pattern"))
    assert sorted(patterns) == ["blocks.0.attn.hook_pattern", "blocks.1.attn.hook_pattern"]
    with pytest.raises(HookError, match="was not cached"):
        patterns["blocks.0.hook_resid_pre"]


def test_unknown_hook_name_suggests_close_names(tiny_model):
    with pytest.raises(HookError, match=r"hook_patern.*Did you mean 'blocks\.0\.attn\.hook_pattern'"):
        run_with_cache(tiny_model, _ids(tiny_model), names_filter="blocks.0.attn.hook_patern")
    with pytest.raises(HookError, match=r"Did you mean 'blocks\.1\.hook_resid_post'"):
        run_with_hooks(tiny_model, _ids(tiny_model), fwd_hooks=[("blocks.1.resid_post", lambda a, h: a)])
    _, cache = run_with_cache(tiny_model, _ids(tiny_model))
    with pytest.raises(HookError, match="Did you mean 'pattern'"):
        cache["patern", 0]


def test_shorthand_keys(tiny_model):
    _, cache = run_with_cache(tiny_model, _ids(tiny_model))
    assert cache["pattern", 0] is cache["blocks.0.attn.hook_pattern"]
    assert cache["resid_post", -1] is cache["blocks.1.hook_resid_post"]
    assert cache["z", 1] is cache["blocks.1.attn.hook_z"]
    assert cache["scale", 0, "ln2"] is cache["blocks.0.ln2.hook_scale"]
    assert cache["embed"] is cache["hook_embed"]
    with pytest.raises(HookError, match=r"out of range.*2 layers \(0\.\.1\)"):
        cache["pattern", 2]
    with pytest.raises(HookError, match="ln1 or ln2"):
        cache["scale", 0]


def test_cached_activations_are_detached_and_can_move(tiny_model):
    logits, cache = run_with_cache(tiny_model, _ids(tiny_model), device="cpu", remove_batch_dim=True)
    assert logits.requires_grad  # the forward pass itself is untouched
    assert not cache["resid_post", 0].requires_grad
    assert cache["resid_post", 0].shape == (_ids(tiny_model).shape[1], tiny_model.config.d_model)
    assert cache["pattern", 0].ndim == 3
    batch = torch.cat([_ids(tiny_model)] * 2)
    _, cache2 = run_with_cache(tiny_model, batch)
    with pytest.raises(InputError, match="batch of 1"):
        cache2.remove_batch_dim()


def test_text_input_and_model_methods_delegate(tiny_model):
    logits_text, cache_text = tiny_model.run_with_cache(TEXT, names_filter="hook_embed")
    logits_ids = tiny_model.run_with_hooks(_ids(tiny_model))
    torch.testing.assert_close(logits_text, logits_ids)
    assert cache_text["embed"].shape[1] == len(TEXT)


def test_hooks_are_removed_even_when_a_hook_raises_and_user_hooks_stay(tiny_model):
    model = tiny_model
    seen = []
    model.hook_points()["hook_embed"].add_hook(lambda act, hook: seen.append(hook.name))

    def explode(act, hook):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        run_with_hooks(model, _ids(model), fwd_hooks=[("blocks.1.hook_resid_mid", explode)])
    with pytest.raises(RuntimeError, match="boom"):
        run_with_hooks(model, _ids(model), fwd_hooks=[(lambda n: n.endswith("hook_z"), explode)])
    run_with_cache(model, _ids(model))
    active = {name for name, point in model.hook_points().items() if point.active}
    assert active == {"hook_embed"}  # only the hook the user attached by hand is left
    assert seen == ["hook_embed"] * 3
    model.reset_hooks()
    assert not any(point.active for point in model.hook_points().values())


def test_reset_hooks_end_false_keeps_hooks_attached(tiny_model):
    model = tiny_model
    zero = lambda act, hook: torch.zeros_like(act)  # noqa: E731
    ablated = run_with_hooks(model, _ids(model), fwd_hooks=[("blocks.0.hook_attn_out", zero)], reset_hooks_end=False)
    torch.testing.assert_close(model(_ids(model)), ablated)  # still attached
    model.reset_hooks()
    assert not torch.allclose(model(_ids(model)), ablated)


def _zero_attention_weights(model, layer, bias=True):
    ablated = copy.deepcopy(model)
    o_proj = ablated.blocks[layer].attn.o_proj
    with torch.no_grad():
        o_proj.weight.zero_()
        if bias and o_proj.bias is not None:
            o_proj.bias.zero_()
    return ablated


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("layer", [0, 1])
def test_zero_ablating_every_head_equals_zeroed_output_projection(make_model, family, layer):
    model = make_model(family)
    ids = _ids(model)
    zero = lambda act, hook: torch.zeros_like(act)  # noqa: E731
    clean = model(ids)

    # hook_attn_out = o_proj(z) + bias: zeroing it is zeroing o_proj's weight and bias.
    by_attn_out = run_with_hooks(model, ids, fwd_hooks=[(f"blocks.{layer}.hook_attn_out", zero)])
    torch.testing.assert_close(by_attn_out, _zero_attention_weights(model, layer)(ids), atol=1e-5, rtol=1e-5)
    # hook_z is before o_proj: zeroing every head leaves only o_proj's bias (GPT-2 has one).
    by_z = run_with_hooks(model, ids, fwd_hooks=[(f"blocks.{layer}.attn.hook_z", zero)])
    torch.testing.assert_close(by_z, _zero_attention_weights(model, layer, bias=False)(ids), atol=1e-5, rtol=1e-5)
    if model.config.attn_out_bias:
        assert not torch.allclose(by_z, by_attn_out, atol=1e-3)
    else:
        torch.testing.assert_close(by_z, by_attn_out)
    assert not torch.allclose(by_attn_out, clean, atol=1e-3)  # the ablation changed something


def test_predicate_hooks_ablate_every_layer(make_model):
    model = make_model("gpt2")
    ids = _ids(model)
    zero = lambda act, hook: torch.zeros_like(act)  # noqa: E731
    ablated = copy.deepcopy(model)
    with torch.no_grad():
        for block in ablated.blocks:
            block.attn.o_proj.weight.zero_()
            block.attn.o_proj.bias.zero_()
    got = run_with_hooks(model, ids, fwd_hooks=[(lambda name: name.endswith("hook_attn_out"), zero)])
    torch.testing.assert_close(got, ablated(ids), atol=1e-5, rtol=1e-5)
