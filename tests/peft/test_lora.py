"""LoRA on a tiny random LLaMA: identity at init, merge/unmerge, several adapters, errors."""

from __future__ import annotations

import pytest
import torch

from lucidlm.config import preset
from lucidlm.errors import AdapterError
from lucidlm import LanguageModel
from lucidlm.peft import (LoRALinear, add_lora, adapter_names, disable_adapters, merge_adapter, merge_and_unload,
                          set_adapter, trainable_parameters_report, unmerge_adapter)


def tiny_model(seed: int = 0) -> LanguageModel:
    torch.manual_seed(seed)
    cfg = preset("llama", vocab_size=97, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_mlp=64, max_seq_len=64)
    return LanguageModel(cfg).eval()


def batch(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(seed))


def train_steps(model: LanguageModel, steps: int = 5, lr: float = 1e-2) -> None:
    """Plain steps of next-token loss: just enough to move B away from zero."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr)
    ids = batch(7)
    model.train()
    for _ in range(steps):
        logits = model(ids[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()


def test_fresh_lora_equals_base_and_only_adapter_trains():
    model = tiny_model()
    ids = batch()
    with torch.no_grad():
        base = model(ids)
    names = add_lora(model, r=4, alpha=8, targets=("q_proj", "v_proj"))
    assert names == ["blocks.0.attn.q_proj", "blocks.0.attn.v_proj", "blocks.1.attn.q_proj", "blocks.1.attn.v_proj"]
    with torch.no_grad():
        assert torch.equal(model(ids), base)  # B = 0: exactly the base model
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {f"blocks.{i}.attn.{m}.lora_{ab}.default" for i in (0, 1) for m in ("q_proj", "v_proj")
                         for ab in "AB"}
    # r * (in + out) per layer: q is 32 -> 32, v is 32 -> 16 (2 kv heads of 8)
    expected = 2 * (4 * (32 + 32) + 4 * (32 + 16))
    total = sum(p.numel() for p in model.parameters())
    assert trainable_parameters_report(model) == (
        f"trainable params: {expected:,d} || all params: {total:,d} || trainable%: {100 * expected / total:.4f}")
    # base weight names are unchanged, so ordinary loaders still find them
    assert "blocks.0.attn.q_proj.weight" in model.state_dict()


def test_lora_output_matches_formula():
    torch.manual_seed(0)
    linear = torch.nn.Linear(6, 5)
    layer = LoRALinear(linear)
    layer.add_adapter("a", r=2, alpha=3.0)
    torch.nn.init.normal_(layer.lora_B["a"])
    x = torch.randn(4, 6)
    A, B = layer.lora_A["a"].detach(), layer.lora_B["a"].detach()
    expected = x @ linear.weight.T + linear.bias + (3.0 / 2) * (x @ A.T @ B.T)
    torch.testing.assert_close(layer(x), expected, rtol=1e-6, atol=1e-6)


def test_merge_unmerge_after_training():
    model = tiny_model()
    base_weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    add_lora(model, r=4, alpha=8, targets="all-linear", init="gaussian")
    train_steps(model)
    assert model.blocks[0].attn.q_proj.lora_B["default"].abs().max() > 0
    ids = batch()
    with torch.no_grad():
        unmerged = model(ids)
        model.merge_adapter()
        merged = model(ids)
    assert (merged - unmerged).abs().max() <= 1e-5
    assert (unmerged - LanguageModel.forward(tiny_model(), ids)).abs().max() > 1e-3  # training changed something
    with pytest.raises(AdapterError, match="already merged"):
        merge_adapter(model)
    model.unmerge_adapter()
    for name, value in model.named_parameters():
        if "lora_" not in name:
            torch.testing.assert_close(value.detach(), base_weights[name], rtol=0, atol=1e-6)
    with pytest.raises(AdapterError, match="nothing to unmerge"):
        unmerge_adapter(model)


def test_merge_in_bf16_goes_through_fp32():
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 64, bias=False).to(torch.bfloat16)
    layer = LoRALinear(linear)
    layer.add_adapter("a", r=4, alpha=8)
    torch.nn.init.normal_(layer.lora_B["a"], std=0.01)
    expected = (linear.weight.float() + 2.0 * layer.lora_B["a"].float() @ layer.lora_A["a"].float()).bfloat16()
    layer.merge()
    assert torch.equal(layer.weight, expected)


def test_several_adapters_switched_by_name():
    model = tiny_model()
    ids = batch()
    add_lora(model, name="one", r=2, alpha=4, targets=("q", "v"))
    train_steps(model)
    with torch.no_grad():
        out_one = model(ids)
    add_lora(model, name="two", r=4, alpha=4, targets=("k_proj", "down_proj"))
    assert adapter_names(model) == ["one", "two"]
    assert not model.blocks[0].attn.q_proj.lora_A["one"].requires_grad  # only the active adapter trains
    train_steps(model)
    with torch.no_grad():
        out_two = model(ids)
        model.set_adapter("one")
        assert torch.equal(model(ids), out_one)
        set_adapter(model, "two")
        assert torch.equal(model(ids), out_two)
        with disable_adapters(model):
            base = model(ids)
        torch.testing.assert_close(base, tiny_model()(ids), rtol=0, atol=0)
    assert (out_one - out_two).abs().max() > 1e-3
    with pytest.raises(AdapterError, match="no LoRA adapter named 'three'.*one, two"):
        set_adapter(model, "three")


def test_merge_and_unload_gives_plain_model():
    model = tiny_model()
    add_lora(model, r=4, alpha=8, targets=("q_proj", "o_proj", "gate_proj"))
    train_steps(model)
    ids = batch()
    with torch.no_grad():
        before = model(ids)
        merge_and_unload(model)
        after = model(ids)
    assert not any(isinstance(m, LoRALinear) for m in model.modules())
    assert set(model.state_dict()) == set(tiny_model().state_dict())
    assert (before - after).abs().max() <= 1e-5


def test_target_patterns_and_regex():
    model = tiny_model()
    assert add_lora(model, name="r", r=2, targets=r"blocks\.1\.mlp\.(up|down)_proj") == [
        "blocks.1.mlp.up_proj", "blocks.1.mlp.down_proj"]


def test_errors():
    model = tiny_model()
    with pytest.raises(AdapterError, match=r"'c_attn' matches no linear layer.*down_proj, gate_proj, k_proj, "
                                           r"o_proj, q_proj, up_proj, v_proj"):
        add_lora(model, targets=("c_attn",))
    for bad in (0, -2):
        with pytest.raises(AdapterError, match=f"r={bad}"):
            add_lora(model, r=bad)
    # v_proj is (16, 32): the rank cannot exceed 16
    with pytest.raises(AdapterError, match=r"r=17 .* blocks\.0\.attn\.v_proj .* \(16, 32\).* <= 16"):
        add_lora(model, r=17)
    assert not any(isinstance(m, LoRALinear) for m in model.modules())  # nothing half-attached
    add_lora(model, r=16)
    with pytest.raises(AdapterError, match="already has a LoRA adapter named 'default'"):
        add_lora(model, r=2)
