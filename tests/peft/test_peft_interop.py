"""LoRA files in Hugging Face PEFT's format, both ways, on a tiny random LLaMA (2 layers):
our adapter runs in transformers+peft, and a peft adapter runs in lucidlm, with equal logits."""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch
from random_weights import share_lora_with_peft
from saved_bytes import saved_for_backward

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from lucidlm import load  # noqa: E402
from lucidlm.config import preset  # noqa: E402
from lucidlm.errors import AdapterError  # noqa: E402
from lucidlm.model.transformer import Transformer  # noqa: E402
from lucidlm.peft import LoRALinear, add_lora, adapter_names, load_adapter, save_adapter  # noqa: E402
from lucidlm.weights.hf import save_hf  # noqa: E402

CONFIG = dict(vocab_size=101, d_model=48, n_layers=2, n_heads=6, n_kv_heads=2, d_mlp=96, max_seq_len=64,
              rope_theta=10000.0)


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    """Our tiny model exported as an HF dir: the one base both libraries load."""
    torch.manual_seed(0)
    model = Transformer(preset("llama", **CONFIG))
    return save_hf(model, tmp_path_factory.mktemp("base"))


def hf_model(base_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()


def ids() -> torch.Tensor:
    return torch.randint(0, CONFIG["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(3))


def train_a_little(model: Transformer, steps: int = 4) -> None:
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-2)
    batch = ids()
    model.train()
    for _ in range(steps):
        logits = model(batch[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()


def test_our_adapter_runs_in_peft(base_dir, tmp_path):
    model = load(base_dir)
    add_lora(model, r=4, alpha=8, targets=("q", "v", "down"))
    train_a_little(model)
    assert model.blocks[1].mlp.down_proj.lora_B["default"].abs().max() > 0
    save_adapter(model, tmp_path, base_model_name_or_path=str(base_dir))

    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 4, 8)
    assert config["target_modules"] == ["down_proj", "q_proj", "v_proj"]

    theirs = peft.PeftModel.from_pretrained(hf_model(base_dir), tmp_path).eval()
    with torch.no_grad():
        ours_logits = model(ids())
        their_logits = theirs(ids()).logits
        base_logits = hf_model(base_dir)(ids()).logits
    assert (ours_logits - base_logits).abs().max() > 1e-3  # the adapter does something
    assert (ours_logits - their_logits).abs().max() <= 1e-4


def test_peft_adapter_runs_in_lucidlm(base_dir, tmp_path):
    torch.manual_seed(1)
    theirs = peft.get_peft_model(hf_model(base_dir), peft.LoraConfig(
        r=3, lora_alpha=6, target_modules=["k_proj", "o_proj", "gate_proj"], task_type="CAUSAL_LM",
        rank_pattern={"gate_proj": 5}, alpha_pattern={"o_proj": 12}))
    with torch.no_grad():  # B starts at zero; randomise it so the adapter is not a no-op
        for name, param in theirs.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.1)
    theirs.save_pretrained(tmp_path)
    theirs.eval()

    model = load(base_dir, adapter=tmp_path)
    assert adapter_names(model) == ["default"]
    assert model.blocks[0].mlp.gate_proj.rank("default") == 5
    assert model.blocks[0].attn.o_proj.scaling["default"] == pytest.approx(12 / 3)
    assert model.blocks[0].attn.k_proj.scaling["default"] == pytest.approx(6 / 3)
    assert model.blocks[0].attn.k_proj.merged_adapter is None  # attached, not merged
    with torch.no_grad():
        ours_logits = model(ids())
        their_logits = theirs(ids()).logits
        base_logits = hf_model(base_dir)(ids()).logits
    assert (their_logits - base_logits).abs().max() > 1e-3
    assert (ours_logits - their_logits).abs().max() <= 1e-4

    # and back out again: our re-export of their adapter still loads in peft with the same result
    save_adapter(model, tmp_path / "again")
    again = peft.PeftModel.from_pretrained(hf_model(base_dir), tmp_path / "again").eval()
    with torch.no_grad():
        assert (again(ids()).logits - their_logits).abs().max() <= 1e-5


def test_adapter_for_another_base_names_tensor_and_shapes(base_dir, tmp_path):
    model = load(base_dir)
    add_lora(model, r=2, targets=("q_proj",))
    save_adapter(model, tmp_path)
    torch.manual_seed(0)
    other = Transformer(preset("llama", **{**CONFIG, "d_model": 60, "n_heads": 6}))
    with pytest.warns(UserWarning, match="different|trained on a base model"):
        with pytest.raises(AdapterError, match=r"'base_model\.model\.model\.layers\.0\.self_attn\.q_proj\.lora_A\.weight'"
                                               r" has shape \(2, 48\) .* needs \(2, 60\)"):
            load_adapter(other, tmp_path)
    assert not any(isinstance(m, LoRALinear) for m in other.modules())

    deeper = Transformer(preset("llama", **{**CONFIG, "n_layers": 1}))
    with pytest.warns(UserWarning):
        with pytest.raises(AdapterError, match=r"layers\.1\.self_attn\.q_proj.*blocks\.1\.attn\.q_proj"):
            load_adapter(deeper, tmp_path)


def test_missing_adapter_dir_is_clear(tmp_path):
    with pytest.raises(AdapterError, match="does not exist"):
        load_adapter(Transformer(preset("llama", **CONFIG)), tmp_path / "nope")


def test_empty_dir_asks_for_the_adapter_files(tmp_path):
    with pytest.raises(AdapterError, match="adapter_config.json does not exist"):
        load_adapter(Transformer(preset("llama", **CONFIG)), tmp_path)


@pytest.mark.parametrize("option, value, named", [
    ("use_dora", True, "DoRA"),
    ("alora_invocation_tokens", [5, 6], "aLoRA"),
    ("lora_bias", True, "lora_bias"),
])
def test_peft_variants_that_compute_otherwise_are_refused(base_dir, tmp_path, option, value, named):
    """A PEFT file of a LoRA variant (saved by peft itself) whose forward is not plain LoRA's:
    read as plain LoRA it would load without a word and give other logits (aLoRA: 3.97 apart
    on this model when the invocation tokens are absent), so lucidlm names the variant instead."""
    theirs = peft.get_peft_model(hf_model(base_dir), peft.LoraConfig(
        r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM", **{option: value}))
    theirs.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "adapter_config.json").read_text())[option] == value
    with pytest.raises(AdapterError, match=f"{named}.*not supported"):
        load(base_dir, adapter=tmp_path)


def test_interleaved_rope_adapter_runs_in_peft_on_the_export(tmp_path):
    """A model with GGUF/Meta's interleaved RoPE is exported with its q/k rows permuted to
    transformers' rotate_half order, so its adapter's q/k lora_B rows must move with them: PEFT
    on the export computes what the model with its adapter computes (0.44 apart on this model when they did not)."""
    torch.manual_seed(0)
    model = Transformer(preset("llama", **CONFIG, rope_variant="interleaved")).eval()
    base = save_hf(model, tmp_path / "base")
    add_lora(model, r=4, alpha=8, targets=("q", "k", "v", "o"))
    with torch.no_grad():  # B starts at zero; randomise it so the adapter is not a no-op
        for layer in (m for m in model.modules() if isinstance(m, LoRALinear)):
            layer.lora_B["default"].normal_(0, 0.3)
    model.eval()
    save_adapter(model, tmp_path / "lora")

    theirs = peft.PeftModel.from_pretrained(hf_model(base), tmp_path / "lora").eval()
    with torch.no_grad():
        ours_logits = model(ids())
        their_logits = theirs(ids()).logits
        assert (their_logits - hf_model(base)(ids()).logits).abs().max() > 1e-1
        assert (ours_logits - their_logits).abs().max() <= 1e-4
        # read back: onto the export (rotate_half) and onto an interleaved model like the one it was trained on
        with warnings.catch_warnings():  # the export is the model it was trained on, q/k rows permuted
            warnings.simplefilter("error")
            assert (load(base, adapter=tmp_path / "lora")(ids()) - their_logits).abs().max() <= 1e-4
        torch.manual_seed(0)
        again = load_adapter(Transformer(preset("llama", **CONFIG, rope_variant="interleaved")), tmp_path / "lora")
        assert (again(ids()) - their_logits).abs().max() <= 1e-4


def test_an_interleaved_adapter_saved_before_format_2_reads_as_written(tmp_path):
    """lucidlm_adapter.json format 1 wrote an interleaved model's q/k rows in the model's own order:
    such a file still loads onto that model unchanged."""
    from safetensors.torch import load_file, save_file

    torch.manual_seed(0)
    model = Transformer(preset("llama", **CONFIG, rope_variant="interleaved")).eval()
    add_lora(model, r=2, targets=("q", "k"))
    with torch.no_grad():
        for layer in (m for m in model.modules() if isinstance(m, LoRALinear)):
            layer.lora_B["default"].normal_(0, 0.3)
    model.eval()
    save_adapter(model, tmp_path)
    # the file as format 1 wrote it: B exactly as the model holds it
    tensors = load_file(tmp_path / "adapter_model.safetensors")
    for i, block in enumerate(model.blocks):
        for p in "qk":
            key = f"base_model.model.model.layers.{i}.self_attn.{p}_proj.lora_B.weight"
            tensors[key] = getattr(block.attn, f"{p}_proj").lora_B["default"].detach().clone()
    save_file(tensors, tmp_path / "adapter_model.safetensors")
    meta = json.loads((tmp_path / "lucidlm_adapter.json").read_text())
    (tmp_path / "lucidlm_adapter.json").write_text(json.dumps({**meta, "format_version": 1}))

    torch.manual_seed(0)
    old = load_adapter(Transformer(preset("llama", **CONFIG, rope_variant="interleaved")), tmp_path)
    with torch.no_grad():
        assert (old(ids()) - model(ids())).abs().max() <= 1e-5


@pytest.mark.parametrize("version, says", [(3, "format_version 3, newer than this lucidlm reads.*upgrade lucidlm"),
                                           ("2", "'format_version' is '2'; expected an integer")])
def test_an_adapter_format_this_lucidlm_cannot_read_is_refused(tmp_path, version, says):
    """A later lucidlm's format (above the one this one writes) or a format_version that is not a
    whole number is refused: read as format 2 or 1, an interleaved model's q/k rows could land in
    the other order without a word (a string "2" was read as format 1)."""
    torch.manual_seed(0)
    model = Transformer(preset("llama", **CONFIG, rope_variant="interleaved")).eval()
    add_lora(model, r=2, targets=("q", "k"))
    save_adapter(model, tmp_path)
    meta = json.loads((tmp_path / "lucidlm_adapter.json").read_text())
    (tmp_path / "lucidlm_adapter.json").write_text(json.dumps({**meta, "format_version": version}))
    torch.manual_seed(0)
    with pytest.raises(AdapterError, match=says):
        load_adapter(Transformer(preset("llama", **CONFIG, rope_variant="interleaved")), tmp_path)


def test_a_format_1_interleaved_adapter_on_the_export_moves_its_rows_as_the_export_did(tmp_path):
    """A format-1 file holds an interleaved model's q/k rows in that model's order. Loaded onto the
    model's Hugging Face export (rotate_half rows), they were read as written: 6.3 logits from the
    model with its adapter on a file lucidlm 78a5620 wrote. They move as the export moved the
    weights, so the export computes what PEFT computes with the same adapter in its own order."""
    from safetensors.torch import load_file, save_file

    torch.manual_seed(0)
    model = Transformer(preset("llama", **CONFIG, rope_variant="interleaved")).eval()
    base = save_hf(model, tmp_path / "base")
    add_lora(model, r=2, targets=("q", "k", "v"))
    with torch.no_grad():
        for layer in (m for m in model.modules() if isinstance(m, LoRALinear)):
            layer.lora_B["default"].normal_(0, 0.3)
    model.eval()
    save_adapter(model, tmp_path / "v2")  # Hugging Face's order: what PEFT reads
    theirs = peft.PeftModel.from_pretrained(hf_model(base), tmp_path / "v2").eval()
    save_adapter(model, tmp_path / "v1")  # rewritten below as format 1 wrote it
    tensors = load_file(tmp_path / "v1" / "adapter_model.safetensors")
    for i, block in enumerate(model.blocks):
        for p in "qk":
            key = f"base_model.model.model.layers.{i}.self_attn.{p}_proj.lora_B.weight"
            tensors[key] = getattr(block.attn, f"{p}_proj").lora_B["default"].detach().clone()
    save_file(tensors, tmp_path / "v1" / "adapter_model.safetensors")
    meta = json.loads((tmp_path / "v1" / "lucidlm_adapter.json").read_text())
    del meta["format_version"]  # format-1 files had none
    (tmp_path / "v1" / "lucidlm_adapter.json").write_text(json.dumps(meta))
    with torch.no_grad():
        their_logits = theirs(ids()).logits
        assert (their_logits - hf_model(base)(ids()).logits).abs().max() > 1e-1
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            ours = load(base, adapter=tmp_path / "v1")
        assert (ours(ids()) - their_logits).abs().max() <= 1e-4


def test_a_prefix_saved_over_a_lora_is_not_read_as_that_lora_by_peft(base_dir, tmp_path):
    """An adapter saved over an earlier one of another method replaces all of it: the LoRA's
    adapter_config.json left beside a prefix made PEFT load the directory as that LoRA, with
    every tensor missing (a warning), that is, as the base model."""
    from lucidlm.peft import add_prefix

    lora = load(base_dir)
    add_lora(lora, r=4, alpha=8, targets=("q", "v"))
    save_adapter(lora, tmp_path, base_model_name_or_path=str(base_dir))
    peft.PeftConfig.from_pretrained(tmp_path)  # PEFT reads the LoRA
    prefixed = load(base_dir)
    add_prefix(prefixed, length=3, hidden=16)
    save_adapter(prefixed, tmp_path)
    with pytest.raises(ValueError, match="adapter_config.json"):  # no LoRA config left for PEFT to read
        peft.PeftConfig.from_pretrained(tmp_path)
    again = load_adapter(load(base_dir), tmp_path)
    with torch.no_grad():
        assert torch.equal(again(ids()), prefixed.eval()(ids()))


def test_a_lora_step_saves_no_more_for_backward_than_peft_and_gets_its_gradients(base_dir):
    """A LoRA step's memory is the activations autograd keeps: frozen layers must not keep
    their inputs (only LoRA's A needs its own), nor the base weights get gradients."""
    torch.manual_seed(2)
    theirs = peft.get_peft_model(hf_model(base_dir), peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, task_type="CAUSAL_LM")).train()
    ours = load(base_dir, dtype=torch.float32)
    add_lora(ours, r=4, alpha=8, targets=("q_proj", "v_proj"), dropout=0.0)
    ours.train()
    share_lora_with_peft(ours, theirs)
    their_modules = dict(theirs.named_modules())
    batch = torch.randint(0, CONFIG["vocab_size"], (4, 33), generator=torch.Generator().manual_seed(5))

    def cross_entropy(logits: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())

    our_loss, our_bytes = saved_for_backward(lambda: cross_entropy(ours(batch[:, :-1])), ours)
    their_loss, their_bytes = saved_for_backward(lambda: cross_entropy(theirs(input_ids=batch[:, :-1]).logits), theirs)
    # Known and left: lucidlm looks RoPE's cos and sin up per row, (B, T, 1, hd) each, where
    # transformers keeps one row (1, 1, T, hd): on SmolLM2 at 4 x 128 tokens 192 KiB of 559 MiB.
    B, T = batch[:, :-1].shape
    per_row_rope = 2 * (B - 1) * T * ours.config.head_dim * 4  # float32 cos and sin, B - 1 rows more
    assert our_bytes <= their_bytes + per_row_rope, (our_bytes, their_bytes)

    our_loss.backward()
    their_loss.backward()
    assert abs(our_loss.item() - their_loss.item()) <= 1e-5
    assert [n for n, p in ours.named_parameters() if p.grad is not None] == \
        [n for n, p in ours.named_parameters() if p.requires_grad]  # only the adapters get gradients
    for i, block in enumerate(ours.blocks):
        for proj in ("q_proj", "v_proj"):
            mine, hf = getattr(block.attn, proj), their_modules[f"base_model.model.model.layers.{i}.self_attn.{proj}"]
            for part in ("lora_A", "lora_B"):
                torch.testing.assert_close(getattr(mine, part)["default"].grad,
                                           getattr(hf, part)["default"].weight.grad, atol=1e-5, rtol=1e-4)
