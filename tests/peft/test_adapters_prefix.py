"""Houlsby adapters and prefix tuning on a tiny random LLaMA: what they compute, what they
train, and that they save and load."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lucidlm.config import preset
from lucidlm.errors import AdapterError
from lucidlm.model.transformer import Transformer
from lucidlm.peft import (add_adapters, add_prefix, adapter_parameter_count, count_parameters, disable_adapters,
                          freeze_prefix, load_adapter, prefix_parameter_count, save_adapter)
from lucidlm.peft.adapters import AdaptedLinear

CONFIG = dict(vocab_size=97, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_mlp=64, max_seq_len=64)


def tiny_model(seed: int = 0, std: float = 0.02) -> Transformer:
    """std: init scale; the training tests use a large one so that logits can move at all
    (with GPT-2's 0.02 a random unembedding caps every logit near zero)."""
    torch.manual_seed(seed)
    model = Transformer(preset("llama", **CONFIG)).eval()
    if std != 0.02:
        model.reset_parameters(std)
    return model


def ids(seed: int = 1, length: int = 12) -> torch.Tensor:
    return torch.randint(0, 97, (2, length), generator=torch.Generator().manual_seed(seed))


def loss_of(model: Transformer, batch: torch.Tensor) -> torch.Tensor:
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())


def train(model: Transformer, steps: int, lr: float) -> tuple[float, float]:
    """(loss before, loss after) on one fixed batch: the new parameters must be able to fit it."""
    batch = ids(5, 24)
    with torch.no_grad():
        before = float(loss_of(model, batch))
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=lr)
    model.train()
    for _ in range(steps):
        opt.zero_grad()
        loss_of(model, batch).backward()
        opt.step()
    model.eval()
    with torch.no_grad():
        return before, float(loss_of(model, batch))


# ---------------------------------------------------------------------------------------- adapters

def test_adapted_linear_computes_the_bottleneck():
    torch.manual_seed(0)
    model = tiny_model()
    add_adapters(model, bottleneck=5)
    layer = model.blocks[1].mlp.down_proj
    assert isinstance(layer, AdaptedLinear)
    torch.nn.init.normal_(layer.adapter.up.weight)  # away from the identity start
    x = torch.randn(3, 64)
    h = x @ layer.weight.T
    a = layer.adapter
    expected = h + F.gelu(h @ a.down.weight.T + a.down.bias) @ a.up.weight.T + a.up.bias
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-6)


def test_adapters_start_as_identity_train_and_round_trip(tmp_path):
    model = tiny_model(std=0.3)
    batch = ids()
    with torch.no_grad():
        base = model(batch)
    names = add_adapters(model, bottleneck=4)
    assert names == ["blocks.0.attn.o_proj", "blocks.0.mlp.down_proj", "blocks.1.attn.o_proj", "blocks.1.mlp.down_proj"]
    with torch.no_grad():
        assert torch.equal(model(batch), base)
    trainable, total = count_parameters(model)
    assert trainable == adapter_parameter_count(32, 4, 2) == 2 * 2 * (32 * 4 + 4 + 4 * 32 + 32)
    assert total == tiny_model().num_parameters() + trainable
    before, after = train(model, steps=30, lr=1e-2)
    assert after < before - 1.0, (before, after)
    with torch.no_grad():
        tuned = model(batch)
        with disable_adapters(model):
            torch.testing.assert_close(model(batch), base, rtol=0, atol=0)
    save_adapter(model, tmp_path)
    reloaded = load_adapter(tiny_model(std=0.3), tmp_path)
    with torch.no_grad():
        assert torch.equal(reloaded(batch), tuned)
    assert count_parameters(reloaded)[0] == 0  # loaded for inference: nothing trains


def test_adapter_errors(tmp_path):
    with pytest.raises(AdapterError, match="bottleneck=0"):
        add_adapters(tiny_model(), bottleneck=0)
    model = tiny_model()
    add_adapters(model, bottleneck=4)
    save_adapter(model, tmp_path)
    other = Transformer(preset("llama", **{**CONFIG, "d_model": 48, "n_heads": 4}))
    with pytest.warns(UserWarning), pytest.raises(AdapterError, match=r"'blocks\.0\.attn\.o_proj\.adapter\.down\.weight' "
                                                                      r"has shape \(4, 32\) .* needs \(4, 48\)"):
        load_adapter(other, tmp_path)
    assert not any(isinstance(m, AdaptedLinear) for m in other.modules())


# ---------------------------------------------------------------------------------------- prefix

def test_prefix_equals_keys_values_already_in_the_cache():
    """Prefix tuning is attention over P extra cached positions: a model whose KV cache holds
    the prefix keys/values in its first P slots must compute the same logits."""
    model = tiny_model()
    encoder = add_prefix(model, length=3, hidden=16)
    torch.nn.init.normal_(encoder.to_kv.weight)  # away from the all-zero start
    batch = ids(2, 7)
    with torch.no_grad():
        with_prefix = model(batch)
        kv = [encoder.layer_kv(i) for i in range(CONFIG["n_layers"])]  # each (2, n_kv, P, hd)
        with disable_adapters(model):
            assert model.prefix_encoder() is None  # switched off
            model.setup_kv_cache(batch_size=2, max_seq_len=16)
            for cache, (k, v) in zip(model.kv_caches, kv):
                cache.update(torch.arange(3), k.expand(2, -1, -1, -1), v.expand(2, -1, -1, -1))
            positions = torch.arange(7)[None].expand(2, 7)
            cached = model(batch, position_ids=positions, input_pos=torch.arange(3, 10))
            model.clear_kv_cache()
    torch.testing.assert_close(with_prefix, cached, rtol=1e-5, atol=1e-5)
    assert (with_prefix - model(batch).detach()).abs().max() == 0  # the prefix came back after the block


def test_prefix_trains_counts_and_freezes(tmp_path):
    model = tiny_model(std=0.3)
    batch = ids()
    add_prefix(model, length=4, hidden=16)
    kv_dim = CONFIG["n_kv_heads"] * (32 // 4)
    trainable, _ = count_parameters(model)
    assert trainable == prefix_parameter_count(32, 2, kv_dim, 4, 16) == 4 * 32 + (32 * 16 + 16) + (16 * 2 * 2 * kv_dim
                                                                                               + 2 * 2 * kv_dim)
    before, after = train(model, steps=30, lr=1e-2)
    assert after < before - 1.0, (before, after)
    with torch.no_grad():
        tuned = model(batch)
        freeze_prefix(model)
        assert count_parameters(model)[0] == 0
        assert model.prefix_encoder.kv.shape == (2, 2, CONFIG["n_kv_heads"], 4, 8)  # (L, k|v, n_kv, P, hd)
        torch.testing.assert_close(model(batch), tuned, rtol=1e-6, atol=1e-6)
    save_adapter(model, tmp_path)
    reloaded = load_adapter(tiny_model(std=0.3), tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(reloaded(batch), tuned, rtol=1e-6, atol=1e-6)


def test_prefix_with_padding_and_generation_cache():
    """Left-padded batches and cached decoding see the prefix too."""
    model = tiny_model()
    add_prefix(model, length=2, hidden=8)
    torch.nn.init.normal_(model.prefix_encoder.to_kv.weight)
    row = ids(9, 6)[:1]
    padded = torch.cat([torch.zeros(1, 2, dtype=torch.long), row], dim=1)
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1]])
    with torch.no_grad():
        alone = model(row)
        in_batch = model(padded, attention_mask=mask)[:, 2:]
        torch.testing.assert_close(in_batch, alone, rtol=1e-5, atol=1e-5)
        model.setup_kv_cache(1, 16)
        first = model(row[:, :4], input_pos=torch.arange(4))
        last = model(row[:, 4:], input_pos=torch.arange(4, 6))
        model.clear_kv_cache()
    torch.testing.assert_close(torch.cat([first, last], 1), alone, rtol=1e-5, atol=1e-5)


def test_prefix_errors():
    with pytest.raises(AdapterError, match="field 'length' is 0; expected a value between 1 and"):
        add_prefix(tiny_model(), length=0)
    with pytest.raises(AdapterError, match="no prefix to freeze"):
        freeze_prefix(tiny_model())


def test_disable_adapters_nests_and_restores_what_was_off():
    """Inside an outer block the base model runs even after an inner block ends, and a part
    switched off before the block stays off after it (each flag comes back as it was)."""
    from lucidlm.peft.adapters import set_adapters_disabled
    from lucidlm.peft.prefix import set_prefix_disabled

    batch = ids()
    for method in ("adapter", "prefix"):
        model = tiny_model(std=0.2)
        with torch.no_grad():
            base = model(batch)
            if method == "adapter":
                add_adapters(model, bottleneck=8)
                for name, param in model.named_parameters():
                    if "adapter" in name:
                        param.normal_(0, 0.2)  # the up-projections start at zero: make them count
            else:
                add_prefix(model, length=3)
            tuned = model(batch)
            assert (tuned - base).abs().max() > 1e-2
            with disable_adapters(model):
                with disable_adapters(model):
                    pass
                assert torch.equal(model(batch), base)
            assert torch.equal(model(batch), tuned)
            (set_adapters_disabled if method == "adapter" else set_prefix_disabled)(model, True)
            with disable_adapters(model):
                pass
            assert torch.equal(model(batch), base)
