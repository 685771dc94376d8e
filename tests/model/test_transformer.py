"""The Transformer's own behaviour: paths that must agree, caches, masks, and bad input."""

from __future__ import annotations

import pytest
import torch

from lucidlm import Transformer, preset
from lucidlm.errors import SequenceTooLongError, TokenIdError

SMALL = dict(vocab_size=97, d_model=64, n_layers=2, max_seq_len=48)
FAMILIES = {
    "llama": preset("llama", n_heads=4, n_kv_heads=2, **SMALL),
    "mqa": preset("llama", n_heads=4, n_kv_heads=1, **SMALL),
    "gpt2": preset("gpt2", n_heads=4, **SMALL),
    "seed000": preset("seed000", n_heads=4, head_dim=16, d_mlp=128, norm_eps=1e-6, **SMALL),
    "seed004": preset("seed004-words", n_heads=4, d_mlp=128, **SMALL),
    "interleaved": preset("llama", n_heads=4, n_kv_heads=2, rope_variant="interleaved", **SMALL),
    "no-positions": preset("llama", n_heads=4, positions="none", **SMALL),
}


def make(name: str) -> Transformer:
    torch.manual_seed(0)
    return Transformer(FAMILIES[name]).eval()


@pytest.fixture(params=sorted(FAMILIES))
def model(request) -> Transformer:
    return make(request.param)


def ids_for(model: Transformer, batch: int = 2, length: int = 20) -> torch.Tensor:
    return torch.randint(0, model.config.vocab_size, (batch, length), generator=torch.Generator().manual_seed(1))


@torch.no_grad()
def test_fast_and_explicit_attention_agree(model: Transformer) -> None:
    ids = ids_for(model)
    fast = model(ids)
    for block in model.blocks:
        block.attn.use_explicit = True
    torch.testing.assert_close(model(ids), fast)


@torch.no_grad()
def test_kv_cache_decoding_equals_full_forward(model: Transformer) -> None:
    ids = ids_for(model)
    full = model(ids)
    model.setup_kv_cache(batch_size=2, max_seq_len=32)
    pieces = [model(ids[:, :7], input_pos=torch.arange(7))]
    for t in range(7, ids.shape[1]):
        pieces.append(model(ids[:, t:t + 1], input_pos=torch.tensor([t])))
    model.clear_kv_cache()
    torch.testing.assert_close(torch.cat(pieces, dim=1), full)


@torch.no_grad()
def test_left_padding_does_not_change_real_tokens(model: Transformer) -> None:
    ids = ids_for(model, batch=1, length=12)
    pad = 5
    padded = torch.cat([torch.zeros(1, pad, dtype=torch.long), ids], dim=1)
    mask = torch.cat([torch.zeros(1, pad), torch.ones(1, 12)], dim=1).long()
    torch.testing.assert_close(model(padded, attention_mask=mask)[:, pad:], model(ids))
    # and with a cache: prefill the padded prompt, then decode one token
    model.setup_kv_cache(batch_size=1, max_seq_len=32)
    model(padded[:, :-1], attention_mask=mask[:, :-1], input_pos=torch.arange(pad + 11))
    last = model(padded[:, -1:], attention_mask=mask, input_pos=torch.tensor([pad + 11]))
    model.clear_kv_cache()
    torch.testing.assert_close(last[:, 0], model(ids)[:, -1])


@torch.no_grad()
def test_last_token_only_and_list_input() -> None:
    model = make("llama")
    ids = ids_for(model, batch=1)
    torch.testing.assert_close(model(ids, last_token_only=True)[:, 0], model(ids)[:, -1])
    torch.testing.assert_close(model(ids[0].tolist()), model(ids))


def test_tied_embeddings_share_one_matrix() -> None:
    model = make("gpt2")
    assert model.unembed.weight is model.embed.weight
    untied = make("llama")
    assert untied.unembed.weight is not untied.embed.weight


def test_post_norm_block_normalises_its_output() -> None:
    model = make("seed000")
    seen = {}
    model.blocks[0].hook_resid_post.add_hook(lambda x, hook: seen.setdefault("x", x))
    model(ids_for(model))
    rms = seen["x"].pow(2).mean(-1).sqrt()
    torch.testing.assert_close(rms, torch.ones_like(rms), atol=1e-3, rtol=0)


def test_bf16_keeps_float64_rope_tables() -> None:
    model = make("llama").to(torch.bfloat16)
    rotary = model.rotary
    assert rotary.cos.dtype == torch.float64
    assert model(ids_for(model)).dtype == torch.bfloat16


def test_empty_build_then_load_equals_original() -> None:
    model = make("seed004")
    empty = Transformer.empty(model.config)
    empty.load_state_dict(model.state_dict())
    ids = ids_for(model)
    torch.testing.assert_close(empty.eval()(ids), model(ids))


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_skeleton_draws_no_random_values(name: str) -> None:
    """A skeleton's weights are all overwritten by its loader, so building it must not run
    torch's initialisers, not even on the meta device (each is a decomposed op per tensor).
    nn.Linear calls ``nn.init.kaiming_uniform_``, which reaches ``uniform_`` inside it."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Recorder(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func.__name__)
            return func(*args, **(kwargs or {}))

    with Recorder() as recorder:
        skeleton = Transformer.skeleton(FAMILIES[name])
    draws = [op for op in recorder.ops if op.split(".")[0] in {"uniform_", "normal_", "zero_", "fill_"}]
    assert draws == []
    assert all(p.is_meta for p in skeleton.parameters())
    # the same ops run where random weights are wanted: the recorder does see them
    with Recorder() as recorder:
        Transformer(FAMILIES[name])
    assert any(op.startswith(("uniform_", "normal_")) for op in recorder.ops)


@pytest.mark.parametrize("bad,message", [
    (-1, r"token id -1 is out of range: this model's vocabulary has ids 0\.\.96 \(vocab_size=97\)"),
    (97, r"token id 97 is out of range: this model's vocabulary has ids 0\.\.96 \(vocab_size=97\)"),
])
def test_out_of_range_ids_are_rejected_before_compute(bad: int, message: str) -> None:
    model = make("llama")
    calls = []
    model.embed.register_forward_hook(lambda *args: calls.append(1))
    with pytest.raises(TokenIdError, match=message):
        model(torch.tensor([[1, 2, bad]]))
    assert calls == []  # nothing ran


def test_sequence_longer_than_context_is_rejected() -> None:
    model = make("llama")
    with pytest.raises(SequenceTooLongError, match=r"49 tokens is longer than the context window of 48 tokens"):
        model(torch.zeros(1, 49, dtype=torch.long))
    model.setup_kv_cache(1, max_seq_len=16)
    with pytest.raises(SequenceTooLongError, match="context window of 16 tokens"):
        model(torch.zeros(1, 17, dtype=torch.long), input_pos=torch.arange(17))


def test_hooks_can_replace_activations_and_cost_nothing_unused() -> None:
    model = make("llama")
    ids = ids_for(model)
    base = model(ids)
    hook = model.hook_points()["blocks.1.hook_mlp_out"]
    hook.add_hook(lambda x, h: torch.zeros_like(x))
    changed = model(ids)
    model.reset_hooks()
    assert not torch.allclose(changed, base)
    torch.testing.assert_close(model(ids), base)
    assert all(not h.active for h in model.hook_points().values())


@pytest.mark.parametrize("padded", [False, True], ids=["no padding", "left padding"])
@torch.no_grad()
def test_a_new_cache_prefill_attends_over_the_prompt_only_and_changes_no_number(model: Transformer,
                                                                                   padded: bool) -> None:
    """``step(..., new_cache=True)`` (generation's prompt pass) scores T keys per query instead
    of the whole cache, and its logits, and the cache it leaves for decoding, are those of
    the plain forward pass."""
    ids = ids_for(model, batch=2, length=12)
    mask = torch.ones(2, 12, dtype=torch.long)
    if padded:
        mask[1, :4] = 0
    model.setup_kv_cache(batch_size=2, max_seq_len=40)
    patterns = []
    hook = model.blocks[0].attn.hook_pattern
    hook.add_hook(lambda t, hook: patterns.append(tuple(t.shape)))
    prefill = model.step(ids[:, :11], torch.arange(11), mask[:, :11] if padded else None, new_cache=True)
    hook.remove_hooks()
    last = model.step(ids[:, 11:], torch.tensor([11]), mask if padded else None)
    model.clear_kv_cache()
    assert patterns == [(2, model.config.n_heads, 11, 11)]  # not (..., 40): the unwritten slots are skipped
    full = model(ids, attention_mask=mask if padded else None)
    first_real = 4 if padded else 0  # a padding query's logits mean nothing
    torch.testing.assert_close(prefill[0], full[0, :11])
    torch.testing.assert_close(prefill[1, first_real:], full[1, first_real:11])
    torch.testing.assert_close(last, full[:, 11:])


@torch.no_grad()
def test_a_new_cache_prefill_keeps_sliding_windows_and_prefixes() -> None:
    """The same with a sliding-window model (keys past the window hidden) and a prefix (every
    query sees it first): against the plain forward pass of the same model."""
    from lucidlm.peft import add_prefix

    torch.manual_seed(0)
    model = Transformer(preset("llama", n_heads=4, n_kv_heads=2, sliding_window=5, **SMALL)).eval()
    add_prefix(model, length=3, hidden=8)
    torch.nn.init.normal_(model.prefix_encoder.to_kv.weight)
    ids = ids_for(model, batch=2, length=14)
    full = model(ids)
    model.setup_kv_cache(batch_size=2, max_seq_len=32)
    prefill = model.step(ids[:, :13], torch.arange(13), new_cache=True)
    last = model.step(ids[:, 13:], torch.tensor([13]))
    model.clear_kv_cache()
    torch.testing.assert_close(torch.cat([prefill, last], dim=1), full)
