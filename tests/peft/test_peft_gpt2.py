"""LoRA on GPT-2 with GPT-2's own target names (c_attn = q, k and v at once; c_proj; c_fc) and
PEFT files for transformers' GPT2LMHeadModel, both ways, on a tiny random GPT-2."""

from __future__ import annotations

import json

import pytest
import torch

from lucidlm import load
from lucidlm.errors import AdapterError
from lucidlm.peft import add_lora, save_adapter

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

VOCAB = 97


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=VOCAB, n_embd=48, n_layer=2, n_head=4,
                                                              n_positions=32))
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.1) if p.ndim == 2 else None
    path = tmp_path_factory.mktemp("gpt2")
    hf.save_pretrained(path)
    return path


def hf_model(base_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()


def ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(3))


def test_our_c_attn_adapter_runs_in_peft(base_dir, tmp_path):
    model = load(base_dir)
    adapted = add_lora(model, r=4, alpha=8, targets="c_attn,c_proj,c_fc")
    assert len(adapted) == 2 * 6  # q, k, v, o, up, down in each block
    attn = model.blocks[0].attn
    assert attn.q_proj.lora_A["default"] is attn.k_proj.lora_A["default"] is attn.v_proj.lora_A["default"]
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-2)
    model.train()
    for _ in range(4):
        batch = ids()
        loss = torch.nn.functional.cross_entropy(model(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    save_adapter(model, tmp_path, base_model_name_or_path=str(base_dir))
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config["target_modules"] == ["c_attn", "c_fc", "c_proj"] and config["fan_in_fan_out"] is True

    theirs = peft.PeftModel.from_pretrained(hf_model(base_dir), tmp_path).eval()
    with torch.no_grad():
        ours_logits, their_logits, base_logits = model(ids()), theirs(ids()).logits, hf_model(base_dir)(ids()).logits
    assert (ours_logits - base_logits).abs().max() > 1e-3
    assert (ours_logits - their_logits).abs().max() <= 1e-4


def test_peft_gpt2_adapter_runs_in_lucidlm(base_dir, tmp_path):
    torch.manual_seed(1)
    theirs = peft.get_peft_model(hf_model(base_dir), peft.LoraConfig(
        r=3, lora_alpha=6, target_modules=["c_attn", "c_proj", "c_fc"], fan_in_fan_out=True, task_type="CAUSAL_LM",
        rank_pattern={"c_fc": 5}))
    with torch.no_grad():
        for name, param in theirs.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.1)
    theirs.save_pretrained(tmp_path)
    theirs.eval()

    model = load(base_dir, adapter=tmp_path)
    attn = model.blocks[1].attn
    assert attn.q_proj.lora_A["default"] is attn.v_proj.lora_A["default"]
    assert model.blocks[0].mlp.up_proj.rank("default") == 5
    with torch.no_grad():
        ours_logits, their_logits, base_logits = model(ids()), theirs(ids()).logits, hf_model(base_dir)(ids()).logits
    assert (their_logits - base_logits).abs().max() > 1e-3
    assert (ours_logits - their_logits).abs().max() <= 1e-4

    save_adapter(model, tmp_path / "again")  # and back out: still peft's adapter
    again = peft.PeftModel.from_pretrained(hf_model(base_dir), tmp_path / "again").eval()
    with torch.no_grad():
        assert (again(ids()).logits - their_logits).abs().max() <= 1e-5


@pytest.mark.parametrize("targets", ["q", "q_proj,v_proj", r"blocks\.0\.attn\.[qkv]_proj|blocks\.1\.attn\.q_proj"])
def test_part_of_c_attn_trains_in_memory_but_is_refused_where_it_would_be_saved(base_dir, tmp_path, targets):
    """Only some of a block's q/k/v could never be a GPT-2 PEFT file: add_lora takes it (a LoRA
    in memory, seed 004's notebook), save_adapter refuses it, and finetune, which saves one,
    refuses it before training, naming the layer and what to target instead."""
    from lucidlm.training.config import FinetuneConfig
    from lucidlm.training.finetune import attach_method

    model = load(base_dir)
    add_lora(model, r=2, targets=targets)
    with pytest.raises(AdapterError, match="target c_attn"):
        save_adapter(model, tmp_path)
    fresh = load(base_dir)
    with pytest.raises(AdapterError, match=r"blocks\.\d\.attn\.q_proj but not all.*Target c_attn"):
        attach_method(fresh, FinetuneConfig(method="lora", rank=2, targets=targets))
    assert not any(hasattr(m, "lora_A") for m in fresh.modules())  # refused before anything changed


def test_split_q_cannot_be_a_gpt2_peft_file(base_dir, tmp_path):
    """The check when saving stays for adapters put together otherwise (a q-only LoRA's layers)."""
    model = load(base_dir)
    add_lora(model, r=2, targets="c_attn")
    attn = model.blocks[0].attn
    attn.k_proj.lora_A["default"] = torch.nn.Parameter(attn.q_proj.lora_A["default"].detach().clone())
    with pytest.raises(AdapterError, match="target c_attn"):
        save_adapter(model, tmp_path)


@pytest.mark.parametrize("targets", ["default", "all-linear"])
def test_default_and_all_linear_adapt_what_peft_adapts_on_gpt2(base_dir, tmp_path, targets):
    """PEFT's default for GPT2LMHeadModel is c_attn, and its all-linear takes c_attn, c_proj and
    c_fc: q, k and v as one layer with one A. lucidlm's same names save the same file, so
    `lucidlm finetune` on a GPT-2 with its default --targets ends in an adapter PEFT loads."""
    model = load(base_dir)
    add_lora(model, r=2, alpha=4, targets=targets)
    attn = model.blocks[1].attn
    assert attn.q_proj.lora_A["default"] is attn.k_proj.lora_A["default"] is attn.v_proj.lora_A["default"]
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.1)
    save_adapter(model, tmp_path)
    peft_targets = None if targets == "default" else targets
    reference = peft.get_peft_model(hf_model(base_dir), peft.LoraConfig(
        r=2, lora_alpha=4, target_modules=peft_targets, fan_in_fan_out=True, task_type="CAUSAL_LM"))
    reference.save_pretrained(tmp_path / "peft")
    from safetensors.torch import load_file
    ours = load_file(tmp_path / "adapter_model.safetensors")
    assert sorted(ours) == sorted(load_file(tmp_path / "peft" / "adapter_model.safetensors"))

    theirs = peft.PeftModel.from_pretrained(hf_model(base_dir), tmp_path).eval()
    with torch.no_grad():
        ours_logits, their_logits, base_logits = model(ids()), theirs(ids()).logits, hf_model(base_dir)(ids()).logits
    assert (ours_logits - base_logits).abs().max() > 1e-3
    assert (ours_logits - their_logits).abs().max() <= 1e-4
