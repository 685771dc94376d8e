"""Model edges against their references: per-head results beside bottleneck adapters
(TransformerLens's ``hook_result``), caller-given positions (transformers' Llama), float64
single-query attention (transformers' Llama in float64 NumPy), torch's mask conventions and kdim/vdim
(``F.scaled_dot_product_attention``, ``nn.MultiheadAttention``), the sinusoidal table (NumPy),
attention-plot labels, and why adapters and prefixes cannot be merged (peft's prefix tuning)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from lucidlm import ModelConfig
from lucidlm.errors import AdapterError, ConfigError, HookError, InputError
from lucidlm.inspect.cache import run_with_cache
from lucidlm.inspect.plots import plot_attention, plot_attention_heads, plot_position_encodings
from lucidlm.language_model import LanguageModel
from lucidlm.model import MultiHeadAttention, scaled_dot_product_attention
from lucidlm.model.positions import sinusoidal_table
from lucidlm.peft import add_adapters, add_prefix
from lucidlm.weights.hf import load_hf
from random_weights import randomize_
from test_multihead import copy_into_torch  # the same nn.MultiheadAttention oracle

pytestmark = pytest.mark.usefixtures("one_thread")


def randn(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A tiny random Llama (4 query heads, 2 key/value heads) in transformers and in lucidlm."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=16, tie_word_embeddings=False)
    hf = randomize_(LlamaForCausalLM(cfg), seed=0, norm_spread=0.2)
    path = tmp_path_factory.mktemp("llama")
    hf.save_pretrained(path)
    return hf, path


# -- 1. use_attn_result beside bottleneck adapters ------------------------------------------

def adapted_model() -> LanguageModel:
    torch.manual_seed(0)
    model = LanguageModel(ModelConfig(vocab_size=40, d_model=32, n_layers=2, n_heads=4, max_seq_len=12,
                                      attn_out_bias=True)).eval()
    add_adapters(model, bottleneck=8)
    with torch.no_grad():  # a trained adapter (a new one is the identity) and a real output bias
        for name, param in model.named_parameters():
            if "adapter" in name or name.endswith("o_proj.bias"):
                param.normal_(0, 0.5)
    return model


@torch.no_grad()
def test_attn_result_beside_adapters_keeps_the_logits_and_hooks_the_pre_adapter_writes():
    """TransformerLens: use_attn_result only adds a hook point, and hook_result[h] = z_h @ W_O[h].
    The adapter is not linear: run per head, it moved the logits by ~7e-2."""
    model = adapted_model()
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    plain = model(ids)
    model.set_use_attn_result(True)
    logits, cache = run_with_cache(model, ids)
    torch.testing.assert_close(logits, plain, atol=1e-6, rtol=0)
    for layer in range(2):
        o_proj = model.blocks[layer].attn.o_proj
        z = cache[f"blocks.{layer}.attn.hook_z"][0]  # (T, nh, hd)
        w_o = o_proj.weight.T.reshape(4, 8, 32)  # (nh, hd, d): TransformerLens's W_O
        result = torch.einsum("thk,hkd->thd", z, w_o)
        torch.testing.assert_close(cache[f"blocks.{layer}.attn.hook_result"][0], result, atol=1e-6, rtol=0)
        adapter = o_proj.adapter
        h = result.sum(1) + o_proj.bias  # the layer's linear output
        by_hand = h + F.linear(F.gelu(F.linear(h, adapter.down.weight, adapter.down.bias)), adapter.up.weight,
                               adapter.up.bias)
        torch.testing.assert_close(cache[f"blocks.{layer}.hook_attn_out"][0], by_hand, atol=1e-6, rtol=0)


@torch.no_grad()
def test_attn_result_beside_disabled_adapters_is_the_base_model():
    from lucidlm.peft import disable_adapters
    model = adapted_model()
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    with disable_adapters(model):
        base = model(ids)
        model.set_use_attn_result(True)
        torch.testing.assert_close(model(ids), base, atol=1e-6, rtol=0)


# -- 2. position_ids are checked at the door ------------------------------------------------

@torch.no_grad()
def test_given_positions_match_transformers(llama):
    hf, path = llama
    model = load_hf(path).eval()
    ids = torch.tensor([[5, 9, 2], [7, 7, 1]])
    positions = torch.tensor([[3, 4, 5], [10, 11, 15]])  # 15 = max_seq_len - 1, the last row of the table
    want = hf(input_ids=ids, position_ids=positions).logits
    torch.testing.assert_close(model(ids, position_ids=positions), want, atol=1e-5, rtol=0)
    shared = torch.tensor([2, 3, 4])  # (T,): the same positions for every row, as transformers broadcasts (1, T)
    want = hf(input_ids=ids, position_ids=shared[None]).logits
    torch.testing.assert_close(model(ids, position_ids=shared), want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("positions", ["rope", "learned", "sinusoidal"])
@pytest.mark.parametrize("bad,message", [([[-1, 0]], "position -1"), ([[15, 16]], "position 16.*0..15"),
                                         ([[0.0, 1.0]], "integer"), ([[0, 1, 2]], r"shape \(1, 3\)")])
def test_bad_positions_are_an_input_error(positions, bad, message):
    """A negative position read the table from its end (position -1 = 15: the logits of the wrong
    rotation, 2.7 from transformers'); 16 died with a raw IndexError."""
    model = LanguageModel(ModelConfig(vocab_size=20, d_model=16, n_layers=1, n_heads=2, max_seq_len=16,
                                      positions=positions)).eval()
    with pytest.raises(InputError, match=message):
        model(torch.tensor([[1, 2]]), position_ids=torch.tensor(bad))


# -- 3. float64 attention stays float64 -----------------------------------------------------

def numpy_llama(hf, ids: list[int]) -> np.ndarray:
    """transformers' Llama written out in float64 NumPy (transformers itself runs its RMSNorm
    in float32 even in a float64 model, so it is no float64 reference): logits (T, V)."""
    c = hf.config
    w = {name: t.detach().double().numpy() for name, t in hf.state_dict().items()}
    nh, nkv = c.num_attention_heads, c.num_key_value_heads
    hd = c.hidden_size // nh
    T = len(ids)
    theta = c.rope_parameters["rope_theta"]
    angles = np.outer(np.arange(T), 1.0 / theta ** (np.arange(0, hd, 2) / hd))  # (T, hd/2)
    doubled = np.concatenate([angles, angles], -1)[:, None]  # (T, 1, hd): pair i is (i, i + hd/2)
    cos, sin = np.cos(doubled), np.sin(doubled)

    def rms(x, weight):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + c.rms_norm_eps) * weight

    def rotate(x):  # (T, heads, hd), rotate_half
        return x * cos + np.concatenate([-x[..., hd // 2:], x[..., :hd // 2]], -1) * sin

    x = w["model.embed_tokens.weight"][ids]  # (T, d)
    for layer in range(c.num_hidden_layers):
        p = f"model.layers.{layer}."
        h = rms(x, w[p + "input_layernorm.weight"])
        q = rotate((h @ w[p + "self_attn.q_proj.weight"].T).reshape(T, nh, hd))
        k = np.repeat(rotate((h @ w[p + "self_attn.k_proj.weight"].T).reshape(T, nkv, hd)), nh // nkv, axis=1)
        v = np.repeat((h @ w[p + "self_attn.v_proj.weight"].T).reshape(T, nkv, hd), nh // nkv, axis=1)
        scores = np.einsum("thd,shd->hts", q, k) / math.sqrt(hd) + np.triu(np.full((T, T), -np.inf), 1)
        pattern = np.exp(scores - scores.max(-1, keepdims=True))
        pattern /= pattern.sum(-1, keepdims=True)
        x = x + np.einsum("hts,shd->thd", pattern, v).reshape(T, nh * hd) @ w[p + "self_attn.o_proj.weight"].T
        h = rms(x, w[p + "post_attention_layernorm.weight"])
        gate = h @ w[p + "mlp.gate_proj.weight"].T
        x = x + (gate / (1 + np.exp(-gate)) * (h @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
    return rms(x, w["model.norm.weight"]) @ w["lm_head.weight"].T


@torch.no_grad()
def test_float64_single_query_and_decode_match_a_float64_numpy_llama(llama):
    """One query (T = 1, every cached decode step) went through float32: ~1e-8 off."""
    hf, path = llama
    ids = [3, 1, 4, 1, 5, 9]
    want = torch.from_numpy(numpy_llama(hf, ids))[None]  # (1, T, V)
    torch.testing.assert_close(hf(input_ids=torch.tensor([ids])).logits.double(), want, atol=1e-5, rtol=0)
    model = load_hf(path).double().eval()
    ids = torch.tensor([ids])
    torch.testing.assert_close(model(ids[:, :1]), want[:, :1], atol=1e-12, rtol=0)
    model.setup_kv_cache(1, 16)
    try:
        model(ids[:, :5], input_pos=torch.arange(5))
        step = model(ids[:, 5:], input_pos=torch.tensor([5]))
    finally:
        model.clear_kv_cache()
    torch.testing.assert_close(step, want[:, 5:], atol=1e-12, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_the_rotation_table_stays_exact_float64_through_a_dtype_change(dtype):
    """model.to(bfloat16) rounded the table through bfloat16 and widened it back (cos off by 2e-3),
    and load_hf's float32 step left a float64 model's table 3e-8 off."""
    model = LanguageModel(ModelConfig(vocab_size=20, d_model=32, n_layers=1, n_heads=4, max_seq_len=24)).to(dtype)
    angles = np.outer(np.arange(24), 1.0 / 10000.0 ** (np.arange(0, 8, 2) / 8))  # (positions, head_dim / 2)
    assert model.rotary.cos.dtype == torch.float64
    np.testing.assert_allclose(model.rotary.cos.numpy(), np.cos(angles), atol=1e-15, rtol=0)
    np.testing.assert_allclose(model.rotary.sin.numpy(), np.sin(angles), atol=1e-15, rtol=0)


def numpy_sinusoidal(n: int, d: int) -> np.ndarray:
    """Vaswani et al.: PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(same)."""
    table = np.zeros((n, d))
    for pos in range(n):
        for i in range(d // 2):
            angle = pos / 10000 ** (2 * i / d)
            table[pos, 2 * i], table[pos, 2 * i + 1] = math.sin(angle), math.cos(angle)
    return table


def test_a_float64_sinusoidal_model_holds_the_exact_table():
    """The table was built in float64 but returned as float32, so .double() widened a rounded one (3e-8)."""
    model = LanguageModel(ModelConfig(vocab_size=20, d_model=16, n_layers=1, n_heads=2, max_seq_len=24,
                                      positions="sinusoidal")).double()
    np.testing.assert_allclose(model.pos_embed.table.numpy(), numpy_sinusoidal(24, 16), atol=1e-14, rtol=0)
    model.float()
    assert model.pos_embed.table.dtype == torch.float32
    np.testing.assert_allclose(model.pos_embed.table.numpy(), numpy_sinusoidal(24, 16).astype(np.float32), atol=0,
                               rtol=0)


def test_an_odd_width_sinusoidal_table_is_refused_clearly():
    with pytest.raises(InputError, match="d_model=5 is odd"):
        plot_position_encodings(max_seq_len=16, d_model=5)
    with pytest.raises(ConfigError, match="d_model=5 is odd"):
        sinusoidal_table(16, 5)
    fig = plot_position_encodings(max_seq_len=8, d_model=6)
    np.testing.assert_allclose(fig.axes[0].get_images()[0].get_array(), numpy_sinusoidal(8, 6), atol=1e-12, rtol=0)


# -- 4. torch's mask conventions ------------------------------------------------------------

@pytest.mark.parametrize("T", [1, 2, 5])
def test_torchs_causal_mask_at_every_length_matches_torch(T):
    """generate_square_subsequent_mask(1) is [[0.]]: read as a keep-mask it blocked every key."""
    q, k, v = randn(1, 2, T, 8, seed=1), randn(1, 2, T, 8, seed=2), randn(1, 2, T, 8, seed=3)
    mask = nn.Transformer.generate_square_subsequent_mask(T)
    out, weights = scaled_dot_product_attention(q, k, v, mask)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
    torch.testing.assert_close(weights.sum(-1), torch.ones(1, 2, T))


def test_an_all_zero_additive_padding_mask_attends_everywhere():
    q, k, v = randn(2, 2, 3, 8, seed=4), randn(2, 2, 6, 8, seed=5), randn(2, 2, 6, 8, seed=6)
    no_padding = torch.zeros(2, 1, 1, 6)  # additive: nothing to hide in this batch
    out, _ = scaled_dot_product_attention(q, k, v, no_padding)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, attn_mask=no_padding))
    keep = torch.tensor([[1.0, 1, 1, 1, 0, 0]])  # seed 004's float 0/1 keep-mask still keeps
    out, _ = scaled_dot_product_attention(q, k, v, keep)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, attn_mask=keep.bool()))


@torch.no_grad()
def test_the_module_at_length_one_with_torchs_causal_mask_matches_nn_multiheadattention():
    torch.manual_seed(0)
    ours = MultiHeadAttention(16, 2)
    theirs = copy_into_torch(ours)
    x = randn(1, 1, 16, seed=7)
    mask = nn.Transformer.generate_square_subsequent_mask(1)
    want, _ = theirs(x, x, x, attn_mask=mask)
    torch.testing.assert_close(ours(x, mask=mask), want)


@torch.no_grad()
def test_kdim_alone_takes_values_from_the_same_memory_and_widths_are_checked():
    torch.manual_seed(1)
    ours = MultiHeadAttention(16, 2, kdim=8)  # values default to the keys: one 8-wide memory
    theirs = copy_into_torch(ours, kdim=8, vdim=8)
    assert ours.v_proj.in_features == theirs.vdim == 8
    q, k = randn(2, 3, 16, seed=8), randn(2, 5, 8, seed=9)
    want, _ = theirs(q, k, k)
    torch.testing.assert_close(ours(q, k), want)
    with pytest.raises(InputError, match=r"value has shape \(2, 5, 16\).*vdim=8"):
        ours(q, k, randn(2, 5, 16, seed=10))
    with pytest.raises(InputError, match=r"key has shape \(2, 5, 16\).*kdim=8"):
        ours(q, q[:, :1].expand(2, 5, 16), k)
    with pytest.raises(InputError, match="batch size"):
        ours(q, k[:1], k[:1])
    separate = MultiHeadAttention(16, 2, kdim=8, vdim=16)  # nn.MultiheadAttention's widths, given
    theirs = copy_into_torch(separate, kdim=8, vdim=16)
    v = randn(2, 5, 16, seed=10)
    torch.testing.assert_close(separate(q, k, v), theirs(q, k, v)[0])


# -- 5. attention plots label every key exactly ---------------------------------------------

def test_attention_plots_refuse_more_labels_than_positions_and_label_a_cached_step():
    model = LanguageModel(ModelConfig(vocab_size=40, d_model=16, n_layers=1, n_heads=2, max_seq_len=12)).eval()
    with torch.no_grad():
        _, cache = run_with_cache(model, torch.tensor([[1, 2, 3]]))
    for plot in (lambda tokens: plot_attention(cache, 0, 0, tokens=tokens),
                 lambda tokens: plot_attention_heads(cache, 0, tokens)):
        with pytest.raises(HookError, match="4 token labels .* 3 positions"):
            plot(["a", "b", "c", "d"])  # was drawn as b, c, d: every label one token off
    fig = plot_attention(cache, 0, 0, tokens=["a", "b", "c"])
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()] == ["a", "b", "c"]
    model.setup_kv_cache(1, 12)
    try:
        with torch.no_grad():
            model(torch.tensor([[1, 2, 3]]), input_pos=torch.arange(3))
            _, step = run_with_cache(model, torch.tensor([[4]]), input_pos=torch.tensor([3]))
    finally:
        model.clear_kv_cache()
    fig = plot_attention(step, 0, 0, tokens=["a", "b", "c", "d"])  # keys: every token so far; query: the last
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()] == ["a", "b", "c", "d"]
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == ["d"]


# -- 6. adapters and prefixes: positions, and why they cannot be merged ----------------------

@torch.no_grad()
def test_a_prefix_with_positions_from_p_matches_peft_prefix_tuning(llama):
    """lucidlm numbers the text from 0 after a prefix (peft/prefix.py's docstring); peft numbers
    it from P. With position_ids counted from P the two are the same model."""
    peft = pytest.importorskip("peft")
    hf, path = llama
    base = LlamaForCausalLM(hf.config)
    base.load_state_dict(hf.state_dict())
    P = 3
    tuned = peft.get_peft_model(base, peft.PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=P)).eval()
    table = tuned.prompt_encoder["default"].embedding.weight  # (P, n_layers * 2 * kv_dim)
    table.normal_(0, 1.0, generator=torch.Generator().manual_seed(3))
    ids = torch.tensor([[5, 9, 1, 33, 20, 7]])
    want = tuned(input_ids=ids).logits
    model = load_hf(path).eval()
    encoder = add_prefix(model, length=P)
    from lucidlm.peft import freeze_prefix
    freeze_prefix(model)
    encoder.kv.copy_(table.view(P, 2 * 2, 2, 8).permute(1, 2, 0, 3).reshape(2, 2, 2, P, 8))
    torch.testing.assert_close(model(ids, position_ids=torch.arange(P, P + 6)), want, atol=1e-5, rtol=0)
    assert (model(ids) - want).abs().max() > 1e-3  # from 0, as documented: not peft's numbers


@pytest.mark.parametrize("attach,what", [(lambda m: add_adapters(m, 4), "bottleneck adapters"),
                                         (lambda m: add_prefix(m, length=2, hidden=4), "a prefix")])
def test_merge_adapter_says_adapters_and_prefixes_cannot_be_merged(attach, what):
    model = LanguageModel(ModelConfig(vocab_size=20, d_model=16, n_layers=1, n_heads=2, max_seq_len=8))
    attach(model)
    with pytest.raises(AdapterError, match=f"no active LoRA adapter to merge. It has {what}.*cannot be merged"):
        model.merge_adapter()
