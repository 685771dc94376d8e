"""Edges of the interpretability layer found in the third bug hunt, each against TransformerLens
3.9, transformers or torch's own autograd on the same tiny random weights: a failed
run_with_hooks leaving hooks behind, head results under a LoRA on o_proj, gradients through
quantized layers, the attention view of a cache without a batch dim, logit attribution on a
model without norms, and the cached gradient at a point whose gradient a bwd hook edits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import lucidlm
from lucidlm.errors import HookError
from lucidlm.inspect import attention_view, run_with_cache, run_with_hooks
from lucidlm.inspect.patching import attr_patch_resid_pre
from lucidlm.inspect.resid import tokens_to_residual_directions
from lucidlm.quantization import QuantizedEmbedding, QuantizedLinear, dense_weight
from lucidlm.quantization import blocks_kernel

pytest.importorskip("transformer_lens")
import tl_oracle  # noqa: E402  (a helper beside this file)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    hf = tl_oracle.hf_model("llama")
    return hf, tl_oracle.lucid_model(hf, tmp_path_factory.mktemp("llama")), tl_oracle.tl_model("llama", hf)


def zero(act, hook):
    return torch.zeros_like(act)


# -- a failed run_with_hooks leaves the model as it was ------------------------------------------
@pytest.mark.parametrize("bad", [("blocks.0.hook_resid_prex", zero), ("blocks.0.hook_resid_pre", "not a function")])
def test_bad_bwd_hook_leaves_no_fwd_hook_attached(llama, bad):
    hf, lucid, _ = llama
    ids = tl_oracle.ids(batch=1)
    with pytest.raises(HookError):
        run_with_hooks(lucid, ids, fwd_hooks=[("blocks.0.hook_attn_out", zero)], bwd_hooks=[bad])
    assert not [n for n, h in lucid.hook_points().items() if h.active]
    with torch.no_grad():
        assert torch.allclose(lucid(ids), hf(ids).logits, atol=1e-4)  # the unhooked model's logits


# -- head results under a LoRA on the attention output ----------------------------------------------
def test_stack_head_results_include_an_active_lora_on_o_proj(tmp_path):
    from lucidlm.peft.lora import add_lora

    hf = tl_oracle.hf_model("llama")
    lucid = tl_oracle.lucid_model(hf, tmp_path)
    add_lora(lucid, r=4, alpha=8, targets="o")
    torch.manual_seed(1)
    with torch.no_grad():
        for i, block in enumerate(lucid.blocks):  # a trained adapter: B no longer zero
            o = block.attn.o_proj
            o.lora_B["default"].normal_(0, 0.3)
            delta = o.lora_B["default"] @ o.lora_A["default"] * (8 / 4)  # PEFT's merge: W += alpha/r * B @ A
            hf.model.layers[i].self_attn.o_proj.weight += delta
    tl = tl_oracle.tl_model("llama", hf)  # TransformerLens on the merged weights
    ids = tl_oracle.ids()
    with torch.no_grad():
        _, cache = run_with_cache(lucid.eval(), ids)
        _, tl_cache = tl.run_with_cache(ids)
    ours = cache.stack_head_results(layer=-1, incl_remainder=True)
    theirs = tl_cache.stack_head_results(layer=-1, incl_remainder=True)
    assert torch.allclose(ours, theirs, atol=1e-4)
    for layer in range(2):  # no output bias: each layer's heads sum to its attn_out
        heads = cache.stack_head_results(layer=layer + 1)[4 * layer:4 * layer + 4]
        assert torch.allclose(heads.sum(0), tl_cache["attn_out", layer], atol=1e-4)


# -- gradients through quantized layers ----------------------------------------------------------------
# (scheme, group size, compute dtype, lucidlm's kernel wanted): the plain int8 path, torch's int8
# kernel, lucidlm's blocks kernel (int8 and int4, reading the float32 stream where it is
# available), torch's int4 tiles in float32 and in bfloat16.
QUANTIZED = [("int8", None, torch.float32, True), ("int8", None, torch.bfloat16, True),
             ("int8", 32, torch.bfloat16, True), ("int4", 32, torch.float32, True),
             ("int4", 32, torch.bfloat16, True), ("int4", 32, torch.bfloat16, False)]
QUANTIZED_IDS = [f"{s}-{g}-{str(d)[6:]}-{'prefer-blocks' if k else 'torch'}" for s, g, d, k in QUANTIZED]


def _tolerance(dtype):
    return 1e-4 if dtype == torch.float32 else 3e-2  # relative: bfloat16 products round to 3 digits


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scheme,group,dtype,blocks", QUANTIZED, ids=QUANTIZED_IDS)
def test_quantized_layer_passes_the_input_gradient(scheme, group, dtype, blocks, x_dtype):
    torch.manual_seed(0)
    with blocks_kernel.prefer(blocks):
        model = torch.nn.Sequential(torch.nn.Linear(64, 32))
        lucidlm.quantize(model, scheme, group, compute_dtype=dtype)
    layer = model[0]
    x = torch.randn(3, 5, 64).to(x_dtype).requires_grad_()
    probe = torch.randn(3, 5, 32)
    (layer(x).float() * probe).sum().backward()
    # torch's autograd on the dequantized weight, in the dtype the layer multiplies in
    ref_x = x.detach().clone().requires_grad_()
    cd = layer.matmul_dtype(x_dtype)
    (F.linear(ref_x.to(cd), layer.dequantize(cd)).float() * probe).sum().backward()
    assert x.grad is not None and x.grad.dtype == x_dtype
    assert _rel(x.grad, ref_x.grad) < _tolerance(cd if x_dtype == torch.float32 else x_dtype)
    with torch.no_grad():  # inference: the kernel itself, no autograd node
        assert layer(x).grad_fn is None


def _quantized_pair(tmp_path, scheme, group, dtype, blocks):
    """A quantized tiny Llama, and TransformerLens on its weights dequantized to float32."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from lucidlm.weights.hf import load_hf
    from lucidlm.weights.hf_names import hf_state_dict
    from random_weights import randomize_

    cfg = LlamaConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=128, max_position_embeddings=64,
                      tie_word_embeddings=False)
    torch.manual_seed(0)
    hf = randomize_(LlamaForCausalLM(cfg), 0, norm_spread=0.2)
    hf.save_pretrained(tmp_path)
    with blocks_kernel.prefer(blocks):
        quantized = lucidlm.quantize(load_hf(tmp_path).eval(), scheme, group, compute_dtype=dtype)
    dense = load_hf(tmp_path).eval()
    with torch.no_grad():
        modules = dict(dense.named_modules())
        for name, module in quantized.named_modules():
            if isinstance(module, (QuantizedLinear, QuantizedEmbedding)):
                modules[name].weight.copy_(dense_weight(module))
        hf.load_state_dict(hf_state_dict(dense), strict=False)
    return quantized, tl_oracle.tl_model("llama", hf)


GRAD_NAMES = ["hook_embed", "blocks.0.hook_resid_pre", "blocks.0.attn.hook_z", "blocks.0.hook_attn_out",
              "blocks.0.mlp.hook_post", "blocks.1.hook_resid_mid", "blocks.1.attn.hook_pattern",
              "blocks.1.hook_mlp_out", "ln_final.hook_scale"]


@pytest.mark.parametrize("scheme,group,dtype,blocks", QUANTIZED, ids=QUANTIZED_IDS)
def test_quantized_run_with_cache_gradients_equal_transformer_lens(tmp_path, scheme, group, dtype, blocks):
    quantized, tl = _quantized_pair(tmp_path, scheme, group, dtype, blocks)
    ids = torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(3))
    _, ours = run_with_cache(quantized, ids, names_filter=GRAD_NAMES, incl_bwd=True)
    _, theirs = tl.run_with_cache(ids, names_filter=GRAD_NAMES, incl_bwd=True, return_type="loss")
    for name in GRAD_NAMES:
        assert name + "_grad" in ours, name
        assert _rel(ours[name + "_grad"], theirs[name + "_grad"]) < 10 * _tolerance(dtype), name
    seen = {}
    run_with_hooks(quantized, ids, bwd_hooks=[("blocks.0.hook_resid_pre", lambda g, hook: seen.update(g=g))]
                   )[0, -1, 5].backward()
    assert seen["g"] is not None and seen["g"].abs().sum() > 0  # a user bwd hook gets a real gradient
    assert not [n for n, h in quantized.hook_points().items() if h.active]


def test_quantized_attribution_patching_equals_transformer_lens(tmp_path):
    quantized, tl = _quantized_pair(tmp_path, "int4", 32, torch.float32, True)
    clean = torch.randint(0, 128, (1, 7), generator=torch.Generator().manual_seed(4))
    corrupted = clean.clone()
    corrupted[0, 2] = (corrupted[0, 2] + 1) % 128

    def metric(logits):
        return logits[0, -1, 5] - logits[0, -1, 9]

    with torch.no_grad():
        _, clean_cache = run_with_cache(quantized, clean)
    ours = attr_patch_resid_pre(quantized, clean_cache, corrupted, metric)  # (layer, pos)
    # TransformerLens by hand: (clean - corrupted) activation times the corrupted run's gradient
    names = [f"blocks.{i}.hook_resid_pre" for i in range(2)]
    _, tl_clean = tl.run_with_cache(clean, names_filter=names)
    acts, grads = {}, {}
    fwd = [(n, lambda a, hook: acts.__setitem__(hook.name, a.detach())) for n in names]
    bwd = [(n, lambda g, hook: grads.__setitem__(hook.name, g.detach())) for n in names]
    with tl.hooks(fwd_hooks=fwd, bwd_hooks=bwd):
        metric(tl(corrupted)).backward()
    theirs = torch.stack([((tl_clean[n] - acts[n]) * grads[n]).sum((0, 2)) for n in names])
    assert torch.allclose(ours, theirs, atol=2e-3 * theirs.abs().max().item())


# -- the attention view of a cache recorded without its batch dim --------------------------------------
def test_attention_view_of_a_batchless_cache(llama):
    _, lucid, tl = llama
    ids = tl_oracle.ids(batch=1)
    with torch.no_grad():
        _, cache = run_with_cache(lucid, ids, remove_batch_dim=True)
        _, tl_cache = tl.run_with_cache(ids)
    view = attention_view(lucid, ids, cache=cache)
    expected = torch.stack([tl_cache["pattern", layer][0] for layer in range(2)])  # (L, nh, T, T)
    assert view.patterns.shape == expected.shape
    assert torch.allclose(view.patterns, expected, atol=1e-5)


# -- logit attribution on a model without norms --------------------------------------------------------
def test_logit_attrs_without_norms_is_the_plain_unembedding(make_model):
    model = make_model("gpt2", norm="none")
    ids = torch.randint(1, 40, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits, cache = run_with_cache(model, ids)
    stack = cache.decompose_resid(pos_slice=-1)  # (n, B, d): sums to the final stream
    right, wrong = torch.tensor([3, 4]), torch.tensor([5, 6])
    # TransformerLens with normalization_type=None: no scaling, directions W_U[:, token]
    w_u = model.unembed.weight.detach().numpy()  # (V, d)
    expected = (stack.numpy() * (w_u[right.numpy()] - w_u[wrong.numpy()])).sum(-1)
    got = cache.logit_attrs(stack, right, wrong, pos_slice=-1)
    assert torch.allclose(got, torch.from_numpy(expected), atol=1e-4)
    batch = torch.arange(2)
    difference = logits[batch, -1, right] - logits[batch, -1, wrong]  # the model's own logits
    assert torch.allclose(got.sum(0), difference, atol=1e-3)
    assert torch.allclose(tokens_to_residual_directions(model, 3), torch.from_numpy(w_u[3]))


# -- the cached gradient is the hook point's own, whatever a bwd hook does to it -------------------------
def test_cached_gradient_ignores_a_bwd_hook_editing_it(llama):
    _, lucid, tl = llama
    ids = tl_oracle.ids(batch=1)
    name, upstream = "blocks.1.hook_resid_mid", "blocks.0.hook_resid_post"

    def double(grad, hook):
        return grad * 2

    lucid.hook_points()[name].add_hook(double, dir="bwd")
    try:
        _, ours = run_with_cache(lucid, ids, incl_bwd=True, names_filter=[name, upstream])
    finally:
        lucid.reset_hooks()
    with tl.hooks(bwd_hooks=[(name, double)]):
        _, theirs = tl.run_with_cache(ids, incl_bwd=True, names_filter=[name, upstream], return_type="loss")
    for key in (name + "_grad", upstream + "_grad"):  # the point's own gradient; upstream, the doubled one
        assert torch.allclose(ours[key], theirs[key], atol=1e-6, rtol=1e-4), key


def test_several_backward_hooks_on_one_point_follow_transformer_lens():
    """Each backward hook sees the point's own gradient and the last value returned wins, as
    TransformerLens's HookPoint gives (a x2 then a x3 hook pass on x3, not x6)."""
    from transformer_lens.hook_points import HookPoint as TLHookPoint

    from lucidlm.model.hooks import HookPoint

    hooks = [lambda grad, hook: grad * 2, lambda grad, hook: None, lambda grad, hook: grad * 3,
             lambda grad, hook: None]
    seen = {}
    grads = {}
    for name, point in (("tl", TLHookPoint()), ("ours", HookPoint())):
        point.name = "p"
        for i, fn in enumerate(hooks):
            def record(grad, hook, fn=fn, i=i, name=name):
                seen[name, i] = grad.clone()
                return fn(grad, hook)
            point.add_hook(record, dir="bwd")
        x = torch.linspace(-1, 1, 6, requires_grad=True)
        (point(x * 1.5) ** 2).sum().backward()
        grads[name] = x.grad
    torch.testing.assert_close(grads["ours"], grads["tl"], rtol=0, atol=0)
    for i in range(len(hooks)):
        torch.testing.assert_close(seen["ours", i], seen["tl", i], rtol=0, atol=0)
