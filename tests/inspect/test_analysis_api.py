"""to_tokens / to_str_tokens / to_string, gradients by hook name, and the errors of bad hooks,
with TransformerLens 3.9 as the oracle (GPT-2's real BPE files from ../shared/data/gpt2)."""

from __future__ import annotations

import json

import pytest
import torch

from lucidlm import preset
from lucidlm.errors import HookError, InputError
from lucidlm.language_model import LanguageModel
from lucidlm.tokenizers.bpe import BPETokenizer

pytest.importorskip("transformer_lens")
import tl_oracle  # noqa: E402

TEXTS = ["Hello world", "The capital of France is Paris", "<|endoftext|>A"]


@pytest.fixture(scope="module")
def gpt2_pair(shared_dir, tmp_path_factory):
    """A tiny GPT-2-shaped model with GPT-2's real tokenizer, in lucidlm and in TransformerLens."""
    from transformer_lens import HookedTransformer, HookedTransformerConfig
    from transformers import GPT2TokenizerFast

    files = shared_dir / "data" / "gpt2"
    ours = BPETokenizer.from_gpt2_files(files / "encoder.json", files / "vocab.bpe")
    saved = tmp_path_factory.mktemp("gpt2-tokenizer")  # TransformerLens reloads its tokenizer from a path
    vocab = json.loads((files / "encoder.json").read_text(encoding="utf-8"))
    merges = [tuple(line.split()) for line in (files / "vocab.bpe").read_text(encoding="utf-8").split("\n")[1:]
              if line.strip()]
    GPT2TokenizerFast(vocab=vocab, merges=merges).save_pretrained(saved)
    theirs = GPT2TokenizerFast.from_pretrained(saved)
    model = LanguageModel(preset("gpt2", vocab_size=50257, d_model=16, n_layers=1, n_heads=2, max_seq_len=32), ours)
    cfg = HookedTransformerConfig(d_model=16, d_head=8, n_heads=2, d_mlp=64, n_layers=1, n_ctx=32, d_vocab=50257,
                                  act_fn="gelu_new", normalization_type="LN", device="cpu")
    return model, HookedTransformer(cfg, tokenizer=theirs)


@pytest.mark.parametrize("prepend_bos", [True, False])
@pytest.mark.parametrize("padding_side", ["right", "left"])
def test_to_tokens_matches_transformer_lens(gpt2_pair, prepend_bos, padding_side):
    model, tl = gpt2_pair
    for text in TEXTS:
        expected = tl.to_tokens(text, prepend_bos=prepend_bos)
        assert torch.equal(model.to_tokens(text, prepend_bos=prepend_bos), expected), text
        assert model.to_str_tokens(text, prepend_bos=prepend_bos) == tl.to_str_tokens(text, prepend_bos=prepend_bos)
    batch = model.to_tokens(TEXTS, prepend_bos=prepend_bos, padding_side=padding_side)
    assert torch.equal(batch, tl.to_tokens(TEXTS, prepend_bos=prepend_bos, padding_side=padding_side))
    assert model.to_string(batch[1]) == tl.to_string(batch[1])
    assert model.to_string(batch) == tl.to_string(batch)
    assert model.to_str_tokens(TEXTS) == [tl.to_str_tokens(t, prepend_bos=False) for t in TEXTS]


def test_numpy_ids_and_lists_of_id_rows_read_as_transformer_lens_reads_them(gpt2_pair):
    """TransformerLens's to_str_tokens / to_string take numpy arrays ((T,), (1, T), one id) and
    lists of (T,) tensors or arrays; lucidlm refused them all as "not token ids"."""
    import numpy as np

    model, tl = gpt2_pair
    ids = model.to_tokens(TEXTS[1])[0].numpy()  # (T,) int64
    rows = [torch.tensor(ids[:3]), torch.tensor(ids[2:5])]
    for value in (ids, ids.astype(np.int32), ids[None], np.array(ids[2]), rows, [r.numpy() for r in rows]):
        assert model.to_str_tokens(value) == tl.to_str_tokens(value), value
    for value in (ids, ids.astype(np.int32), ids[None], np.array(ids[2]), np.stack([r.numpy() for r in rows]),
                  [r.numpy() for r in rows]):
        assert model.to_string(value) == tl.to_string(value), value
    with pytest.raises(InputError, match="integer token ids.*float64"):
        model.to_string(ids.astype(np.float64))


def test_a_padded_batch_gives_each_row_the_logits_it_has_alone(gpt2_pair):
    model, _ = gpt2_pair
    torch.manual_seed(0)
    for padding_side in ("right", "left"):
        ids, mask = model.to_tokens(TEXTS[:2], prepend_bos=True, padding_side=padding_side, return_attention_mask=True)
        with torch.no_grad():
            logits, cache = model.run_with_cache(TEXTS[:2], prepend_bos=True, padding_side=padding_side)
            short = model(model.to_tokens(TEXTS[0], prepend_bos=True))[0]
        real = mask[0].bool()
        assert int(real.sum()) == short.shape[0] < ids.shape[1]
        torch.testing.assert_close(logits[0][real], short, atol=1e-5, rtol=0)
        assert cache["resid_pre", 0].shape[:2] == ids.shape


def test_prepend_bos_on_smollm2(smollm2):
    """SmolLM2's tokenizer adds no BOS of its own; prepend_bos=True puts its BOS first, once."""
    model = smollm2
    bos = model.tokenizer.bos_id
    plain = model.to_tokens("The capital of France is")
    with_bos = model.to_tokens("The capital of France is", prepend_bos=True)
    assert with_bos[0, 0] == bos and torch.equal(with_bos[:, 1:], plain)
    assert torch.equal(model.to_tokens("The capital of France is", prepend_bos=False), plain)


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def pair(request, tmp_path_factory):
    hf = tl_oracle.hf_model(request.param)
    return tl_oracle.lucid_model(hf, tmp_path_factory.mktemp(request.param)), tl_oracle.tl_model(request.param, hf)


def test_gradients_cached_by_name_match_transformer_lens(pair):
    lucid, tl = pair
    ids = tl_oracle.ids()
    from lucidlm.inspect import run_with_cache
    _, cache = run_with_cache(lucid, ids, incl_bwd=True)  # the next-token loss, as return_type="loss"
    lucid.zero_grad(set_to_none=True)
    _, tl_cache = tl.run_with_cache(ids, return_type="loss", incl_bwd=True)
    grads = [name for name in cache if name.endswith("_grad")]
    assert len(grads) == len(list(lucid.hook_points()))
    for name in grads:
        assert cache[name].abs().max() > 0, name
        if ".ln1." in name:  # TransformerLens runs ln1 three times (for q, k and v): see below
            continue
        torch.testing.assert_close(cache[name], tl_cache[name], atol=1e-6, rtol=1e-4, msg=name)

    # TransformerLens's ln1 hooks fire once per use (q, k, v) and its cache keeps one of the
    # three gradients; lucidlm's ln1 runs once, so its gradient is their sum.
    fired: dict[str, list[torch.Tensor]] = {}

    def record(grad, hook):
        fired.setdefault(hook.name, []).append(grad.clone())
    loss = tl.run_with_hooks(ids, return_type="loss", reset_hooks_end=False,
                             bwd_hooks=[(lambda n: ".ln1." in n, record)])
    loss.backward()
    tl.reset_hooks()
    tl.zero_grad(set_to_none=True)
    for name, grads_of_uses in fired.items():
        assert len(grads_of_uses) == 3, name
        torch.testing.assert_close(cache[name + "_grad"], sum(grads_of_uses), atol=1e-6, rtol=1e-4, msg=name)


def test_backward_hooks_see_and_can_replace_gradients(pair):
    lucid, _ = pair
    ids = tl_oracle.ids()
    from lucidlm.inspect import run_with_cache, run_with_hooks
    _, cache = run_with_cache(lucid, ids, names_filter="blocks.1.hook_resid_mid", incl_bwd=True,
                              metric=lambda logits: logits[:, -1, 7].sum())
    seen = {}

    def record(grad, hook):
        seen[hook.name] = grad.clone()

    def block(grad, hook):
        return torch.zeros_like(grad)

    logits = run_with_hooks(lucid, ids, bwd_hooks=[("blocks.1.hook_resid_mid", record),
                                                   ("blocks.0.hook_resid_post", block)])
    lucid.zero_grad(set_to_none=True)
    logits[:, -1, 7].sum().backward()  # the hooks were reset, yet fire: bound to this pass
    torch.testing.assert_close(seen["blocks.1.hook_resid_mid"], cache["blocks.1.hook_resid_mid_grad"])
    # Zeroing the gradient at the output of block 0 cuts every path back into block 0...
    first = lucid.blocks[0].attn.q_proj.weight
    assert first.grad is None or first.grad.abs().max() == 0
    lucid.zero_grad(set_to_none=True)
    run_with_hooks(lucid, ids)[:, -1, 7].sum().backward()
    assert first.grad.abs().max() > 0  # ...which without the hook it reaches
    lucid.zero_grad(set_to_none=True)


def test_bad_hooks_get_clear_errors(pair):
    lucid, _ = pair
    ids = tl_oracle.ids()
    from lucidlm.inspect import run_with_hooks
    with pytest.raises(HookError, match=r"Did you mean 'blocks\.0\.hook_resid_pre'"):
        run_with_hooks(lucid, ids, fwd_hooks=[("blocks.0.hook_resid_pr", lambda a, h: None)])
    with pytest.raises(HookError, match=r"opt-in.*set_use_attn_result\(True\)"):
        run_with_hooks(lucid, ids, fwd_hooks=[("blocks.0.attn.hook_result", lambda a, h: None)])
    with pytest.raises(HookError, match=r"'blocks\.1\.attn\.hook_z' returned shape \(2, 9, 4\).*\(2, 9, 4, 12\)"):
        run_with_hooks(lucid, ids, fwd_hooks=[("blocks.1.attn.hook_z", lambda a, h: a.sum(-1))])
    with pytest.raises(HookError, match=r"returned str"):
        run_with_hooks(lucid, ids, fwd_hooks=[("hook_embed", lambda a, h: "oops")])
    with pytest.raises(InputError, match="scalar"):
        from lucidlm.inspect import run_with_cache
        run_with_cache(lucid, ids, names_filter="hook_embed", incl_bwd=True, metric=lambda logits: logits)
    assert not any(p.active for p in lucid.hook_points().values())  # nothing left attached
