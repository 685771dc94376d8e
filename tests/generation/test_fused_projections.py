"""Fused q/k/v and gate/up kernels (model/fused.py): one matmul per group, exactly the
parts' outputs, saved as the parts, and dropped for the parts whenever they change."""

from __future__ import annotations

import copy

import pytest
import torch
from generation_toys import toy_model

import lucidlm
from lucidlm.generation.decode import DecodeSession
from lucidlm.language_model import LanguageModel
from lucidlm.model.fused import FusedLinear, fuse_projections
from lucidlm.quantization import Int4Linear, blocks_kernel
from lucidlm.quantization.swap import set_module

WIDE = dict(d_model=128, n_heads=4, n_kv_heads=2, multiple_of=64)  # q 128, k/v 64, mlp 384: whole packing blocks


def int4_toy(seed: int) -> LanguageModel:
    return lucidlm.quantize(toy_model(seed=seed, model_cls=LanguageModel, **WIDE), "int4")


def logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids)


IDS = torch.randint(3, 200, (2, 11), generator=torch.Generator().manual_seed(0))


def test_fused_int4_projections_are_the_parts_exactly_and_share_their_codes():
    model = int4_toy(1)
    unfused = copy.deepcopy(model)
    assert fuse_projections(model) == 2 * model.config.n_layers  # q/k/v and gate/up in every block
    assert fuse_projections(model) == 0  # idempotent: kernels that still serve are kept
    attn, mlp = model.blocks[0].attn, model.blocks[0].mlp
    assert isinstance(attn.fused_qkv, FusedLinear) and attn.fused_qkv.widths == [128, 64, 64]
    assert torch.equal(logits(model, IDS), logits(unfused, IDS))  # same kernel, same rows: bit for bit
    _, cache = model.run_with_cache(IDS)  # every hook point sees what it saw before fusing
    _, reference = unfused.run_with_cache(IDS)
    assert cache.keys() == reference.keys() and "blocks.0.attn.hook_k" in cache and "blocks.1.mlp.hook_pre" in cache
    assert all(torch.equal(cache[name], reference[name]) for name in reference.keys())
    # Checkpoints hold the parts only, unchanged.
    assert model.state_dict().keys() == unfused.state_dict().keys()
    for name, value in unfused.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name
    # No second copy of the codes: every part reads its rows of the fused tiles.
    for fused, parts in ((attn.fused_qkv, (attn.q_proj, attn.k_proj, attn.v_proj)),
                         (mlp.fused_gate_up, (mlp.gate_proj, mlp.up_proj))):
        storage = fused.kernel.weight_int4.untyped_storage().data_ptr()
        assert all(p.weight_int4.untyped_storage().data_ptr() == storage for p in parts)


def test_parts_that_change_are_run_instead_of_the_fused_kernel():
    model = int4_toy(2)
    fuse_projections(model)
    other = int4_toy(3)
    # A torch hook on a part runs, and sees the part's own output.
    seen = []
    handle = model.blocks[1].attn.k_proj.register_forward_hook(lambda m, i, out: seen.append(out.shape))
    unfused = copy.deepcopy(model)
    assert torch.equal(logits(model, IDS), logits(unfused, IDS)) and seen == [(2, 11, 64)] * 2
    handle.remove()
    # Weights loaded from another model replace the parts' codes: the fused kernel is stale.
    model.load_state_dict(other.state_dict())
    assert torch.equal(logits(model, IDS), logits(other, IDS))
    assert not model.blocks[0].attn.fused_qkv.serves(*(model.blocks[0].attn.get_submodule(n)
                                                      for n in ("q_proj", "k_proj", "v_proj")))
    assert fuse_projections(model) == 2 * model.config.n_layers  # fused again from the new codes
    assert torch.equal(logits(model, IDS), logits(other, IDS))
    # A part swapped for another module: that module runs.
    set_module(model, "blocks.0.mlp.up_proj", copy.deepcopy(other.blocks[0].mlp.up_proj))
    set_module(other, "blocks.0.mlp.up_proj", copy.deepcopy(other.blocks[0].mlp.up_proj))
    assert torch.equal(logits(model, IDS), logits(other, IDS))


def test_layers_that_cannot_be_fused_are_left_alone():
    float_model = toy_model(seed=4, model_cls=LanguageModel, **WIDE)
    assert fuse_projections(float_model) == 0 and float_model.blocks[0].attn.fused_qkv is None
    with blocks_kernel.prefer(False):  # torch's tiles: k/v's 32 rows are not a whole 64-row block
        narrow = lucidlm.quantize(toy_model(seed=4, model_cls=LanguageModel), "int4")
    assert narrow.blocks[0].attn.k_proj.out_features % 64 != 0
    assert Int4Linear.concatenated((narrow.blocks[0].attn.q_proj, narrow.blocks[0].attn.k_proj)) is None
    # lucidlm's kernel fuses any 16-row multiples, but not parts with different groupings
    ours = lucidlm.quantize(toy_model(seed=4, model_cls=LanguageModel), "int4")
    assert ours.blocks[0].attn.q_proj.uses_blocks_kernel
    assert Int4Linear.concatenated((ours.blocks[0].attn.q_proj, ours.blocks[0].attn.k_proj)) is not None
    with blocks_kernel.prefer(False):
        tiles = lucidlm.quantize(toy_model(seed=4, model_cls=LanguageModel), "int4")
    assert Int4Linear.concatenated((ours.blocks[0].attn.q_proj, tiles.blocks[0].attn.k_proj)) is None
    fuse_projections(narrow)
    assert narrow.blocks[0].attn.fused_qkv is None
    assert torch.equal(logits(narrow, IDS), logits(copy.deepcopy(narrow), IDS))


@pytest.mark.parametrize("backend", ["aot_eager"])
def test_compiled_fused_steps_follow_weights_loaded_after_compile(backend):
    """compile() fuses; a state dict loaded afterwards re-installs the parts, which the
    structure check sees (their ``installs``), so the next generation re-traces on the parts.
    Checked on the logits of the compiled prompt pass and decode step, not on greedy tokens:
    a compiled int4 prompt multiplies through F.linear on the dequantized weights
    (quantization/int4.py), equal to the eager kernel only to bfloat16 rounding, and this
    random toy's top two logits are one bfloat16 step apart."""
    model, other = int4_toy(5), int4_toy(6)
    ids = torch.tensor([[5, 6, 7, 8]])
    eager = [logits(model, ids)[0, -2:], logits(other, ids)[0, -2:]]  # (2, V): after token 3, after token 4

    def compiled_logits() -> torch.Tensor:
        with DecodeSession(model, [[5, 6, 7]], capacity=4) as session:
            return torch.stack([session.prefill()[0], session.step(torch.tensor([8]))[0]])

    model.compile(backend=backend)
    assert model.blocks[0].attn.fused_qkv is not None
    torch.testing.assert_close(compiled_logits(), eager[0].float(), atol=0.5, rtol=0.02)
    model.load_state_dict(other.state_dict())
    torch.testing.assert_close(compiled_logits(), eager[1].float(), atol=0.5, rtol=0.02)
    assert (eager[0] - eager[1]).abs().max() > 5  # the two models are far apart: the check can tell them apart


def test_load_fuses_a_quantized_model_and_leaves_a_float_one():
    int4 = lucidlm.load("llama", random_init=True, quantize="int4", n_layers=1, d_model=128, n_heads=4,
                        n_kv_heads=2, multiple_of=64, vocab_size=300, max_seq_len=64)
    assert isinstance(int4.blocks[0].attn.fused_qkv, FusedLinear) and isinstance(int4.blocks[0].mlp.fused_gate_up,
                                                                              FusedLinear)
    assert fuse_projections(int4) == 0  # already fused
    float_model = lucidlm.load("llama", random_init=True, n_layers=1, d_model=128, n_heads=4, n_kv_heads=2,
                               multiple_of=64, vocab_size=300, max_seq_len=64)
    assert float_model.blocks[0].attn.fused_qkv is None and float_model.blocks[0].mlp.fused_gate_up is None



def float_parts(model: LanguageModel, block: int = 0) -> tuple[torch.nn.Module, ...]:
    attn = model.blocks[block].attn
    return attn.q_proj, attn.k_proj, attn.v_proj


@pytest.mark.parametrize("with_bias", [False, True])
def test_fused_float_projections_hold_the_parts_weights_once(with_bias):
    """float_layers=True (what compile() asks for on CUDA): one matrix whose rows are the parts'
    weights, the same Parameter objects; outputs, hook values and checkpoints as before."""
    model = toy_model(seed=7, model_cls=LanguageModel, attn_bias=with_bias, **WIDE)
    unfused = copy.deepcopy(model)
    params = [p.weight for p in float_parts(model)]
    assert fuse_projections(model) == 0  # not asked: float layers are left alone
    assert fuse_projections(model, float_layers=True) == 2 * model.config.n_layers
    assert fuse_projections(model, float_layers=True) == 0  # idempotent
    fused = model.blocks[0].attn.fused_qkv
    assert fused.widths == [128, 64, 64] and fused.sharing
    assert [p.weight for p in float_parts(model)] == params  # the same Parameters, identity kept
    storage = fused.kernel.weight.untyped_storage().data_ptr()
    assert all(p.weight.untyped_storage().data_ptr() == storage for p in float_parts(model))
    assert (fused.kernel.bias is not None) == with_bias
    torch.testing.assert_close(logits(model, IDS), logits(unfused, IDS), atol=1e-5, rtol=1e-5)
    _, cache = model.run_with_cache(IDS)
    _, reference = unfused.run_with_cache(IDS)
    for name in ("blocks.0.attn.hook_q", "blocks.1.attn.hook_v", "blocks.1.mlp.hook_pre"):
        torch.testing.assert_close(cache[name], reference[name], atol=1e-5, rtol=1e-5)
    assert model.state_dict().keys() == unfused.state_dict().keys()
    for name, value in unfused.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name


def test_fused_float_projections_follow_edits_and_step_aside_for_autograd():
    model = toy_model(seed=8, model_cls=LanguageModel, **WIDE)
    unfused = copy.deepcopy(model)
    fuse_projections(model, float_layers=True)
    # An in-place edit of a part is an edit of the fused matrix.
    with torch.no_grad():
        for m in (model, unfused):
            m.blocks[0].attn.k_proj.weight.mul_(3.0)
            m.blocks[1].mlp.up_proj.weight[:5] = 0.25
    torch.testing.assert_close(logits(model, IDS), logits(unfused, IDS), atol=1e-5, rtol=1e-5)
    # While autograd records, the parts run and their parameters get the gradients.
    model(IDS).logsumexp(-1).sum().backward()
    assert all(p.weight.grad is not None and p.weight.grad.abs().sum() > 0 for p in float_parts(model, 1))
    # A part given a new Parameter no longer shares the matrix: the parts run.
    fresh = torch.nn.Parameter(torch.randn_like(model.blocks[1].attn.v_proj.weight))
    model.blocks[1].attn.v_proj.weight = fresh
    unfused.blocks[1].attn.v_proj.weight = torch.nn.Parameter(fresh.detach().clone())
    with torch.no_grad():
        assert not model.blocks[1].attn.fused_qkv.serves(*float_parts(model, 1))
        assert model.blocks[0].attn.fused_qkv.serves(*float_parts(model, 0))
    torch.testing.assert_close(logits(model, IDS), logits(unfused, IDS), atol=1e-5, rtol=1e-5)
    # A conversion gives every part its own tensor: the fused matrices are dropped, the parts run.
    model.to(torch.float64)
    assert model.blocks[0].attn.fused_qkv.kernel is None
    torch.testing.assert_close(logits(model, IDS.clone()), logits(unfused.to(torch.float64), IDS))


def test_compiled_steps_notice_a_float_part_that_stopped_sharing():
    """The traced step reads the ``sharing`` flag, not pointers: the structure check before each
    generation refreshes it, so a part given a new Parameter after compile() is re-traced on."""
    model = toy_model(seed=9, model_cls=LanguageModel, **WIDE)
    fuse_projections(model, float_layers=True)
    model.compile(backend="aot_eager")
    assert model.blocks[0].attn.fused_qkv.sharing
    prompt = [5, 6, 7, 8]

    def tokens() -> list[int]:
        return model.generate(prompt, max_new_tokens=8, temperature=0, stop_on_eos=False).token_ids

    def eager_tokens() -> list[int]:
        reference = toy_model(seed=9, model_cls=LanguageModel, **WIDE)
        reference.load_state_dict(model.state_dict())
        return reference.generate(prompt, max_new_tokens=8, temperature=0, stop_on_eos=False).token_ids

    assert tokens() == eager_tokens()
    q = model.blocks[0].attn.q_proj
    q.weight = torch.nn.Parameter(torch.randn_like(q.weight) * 0.5)
    assert tokens() == eager_tokens()
    assert not model.blocks[0].attn.fused_qkv.sharing


def test_a_model_with_fused_float_projections_saves_and_loads(tmp_path):
    """The parts are views of one matrix; the checkpoint holds them as separate tensors."""
    from lucidlm.weights.checkpoint import save_model

    model = toy_model(seed=10, model_cls=LanguageModel, **WIDE)
    fuse_projections(model, float_layers=True)
    save_model(model, tmp_path / "fused")
    loaded = lucidlm.load(tmp_path / "fused")
    assert loaded.blocks[0].attn.fused_qkv is None  # loading builds nothing for float layers
    assert torch.equal(loaded.blocks[0].attn.k_proj.weight, model.blocks[0].attn.k_proj.weight)
    torch.testing.assert_close(logits(loaded, IDS), logits(model, IDS), atol=1e-5, rtol=1e-5)
