"""Edges of the interpretability layer found in the second bug hunt, each against TransformerLens
3.9 (or transformers) on the same tiny random weights: batch_slice on a stack without a batch
dim, Gemma's scaled hook_embed, the logit lens under a final-logit softcap, the masked default
loss of a padded batch, last_token_only caches, decode-step attention patterns, tokens given as
text on a tokenizer that adds BOS, a list of texts in the logit lens, grouped key heads in
patching, and TransformerLens's shorthand aliases."""

from __future__ import annotations

import json

import pytest
import torch

import lucidlm.inspect.patching as patching
from lucidlm import LanguageModel, preset
from lucidlm.errors import HookError, InputError
from lucidlm.inspect import logit_lens, run_with_cache, run_with_hooks
from lucidlm.inspect.plots import attention_pattern, plot_attention
from lucidlm.inspect.tokens import to_tokens
from lucidlm.inspect.views import attention_view

pytest.importorskip("transformer_lens")
import tl_oracle  # noqa: E402  (a helper beside this file)

ATOL = 1e-5


def metric(logits):
    return logits[0, -1, 5] - logits[0, -1, 9]


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def pair(request, tmp_path_factory):
    family = request.param
    hf = tl_oracle.hf_model(family)
    lucid = tl_oracle.lucid_model(hf, tmp_path_factory.mktemp(family))
    tl = tl_oracle.tl_model(family, hf, fold_ln=True)  # fold_ln: logit_attrs' directions; activations unchanged
    ids = tl_oracle.ids()  # (2, 9)
    with torch.no_grad():
        _, cache = run_with_cache(lucid, ids)
        _, tl_cache = tl.run_with_cache(ids)
    return dict(family=family, hf=hf, lucid=lucid, tl=tl, ids=ids, cache=cache, tl_cache=tl_cache)


@pytest.fixture(scope="module")
def llama_pair(tmp_path_factory):
    hf = tl_oracle.hf_model("llama")  # 4 query heads, 2 key/value heads
    return hf, tl_oracle.lucid_model(hf, tmp_path_factory.mktemp("llama")), tl_oracle.tl_model("llama", hf)


@pytest.fixture(scope="module")
def gpt2_bpe_pair(shared_dir, tmp_path_factory):
    """A tiny random GPT-2 with GPT-2's real tokenizer, in lucidlm and in TransformerLens."""
    from transformer_lens import HookedTransformer
    from transformer_lens.pretrained.weight_conversions import convert_gpt2_weights
    from transformers import GPT2Config, GPT2LMHeadModel, GPT2TokenizerFast

    from lucidlm.tokenizers.bpe import BPETokenizer
    from lucidlm.weights.hf import load_hf
    from random_weights import randomize_

    files = shared_dir / "data" / "gpt2"
    saved = tmp_path_factory.mktemp("gpt2-tokenizer")
    vocab = json.loads((files / "encoder.json").read_text(encoding="utf-8"))
    merges = [tuple(line.split()) for line in (files / "vocab.bpe").read_text(encoding="utf-8").split("\n")[1:]
              if line.strip()]
    GPT2TokenizerFast(vocab=vocab, merges=merges).save_pretrained(saved)
    torch.manual_seed(0)
    hf = randomize_(GPT2LMHeadModel(GPT2Config(vocab_size=50257, n_embd=32, n_layer=2, n_head=4, n_positions=64)),
                    0, 0.2)
    weights = tmp_path_factory.mktemp("gpt2-bpe")
    hf.save_pretrained(weights)
    lucid = load_hf(weights).eval()
    lucid.tokenizer = BPETokenizer.from_gpt2_files(files / "encoder.json", files / "vocab.bpe")
    cfg = tl_oracle.tl_config("gpt2", hf)
    tl = HookedTransformer(cfg, tokenizer=GPT2TokenizerFast.from_pretrained(saved))
    tl.load_and_process_state_dict(convert_gpt2_weights(hf, cfg), fold_ln=False, center_writing_weights=False,
                                   center_unembed=False, fold_value_biases=False,
                                   refactor_factored_attn_matrices=False)
    return lucid, tl.eval()


# -- 1. batch_slice on a stack without a batch dim ----------------------------------------------
def test_batch_slice_picks_the_scale_row_for_a_stack_without_batch_dim(pair):
    cache, tl_cache = pair["cache"], pair["tl_cache"]
    stack = cache.accumulated_resid(layer=1)[:, 1]  # 2 components of batch row 1 (as many as the batch)
    for layer in (1, None):
        ours = cache.apply_ln_to_stack(stack, layer, batch_slice=1, has_batch_dim=False)
        theirs = tl_cache.apply_ln_to_stack(stack, layer, batch_slice=1, has_batch_dim=False)
        torch.testing.assert_close(ours, theirs, atol=ATOL, rtol=0)
    last = cache.decompose_resid(pos_slice=-1)[:, 1]  # (n, d): row 1, last position
    ours = cache.logit_attrs(last, 5, 7, pos_slice=-1, batch_slice=1, has_batch_dim=False)
    theirs = tl_cache.logit_attrs(last, 5, 7, pos_slice=-1, batch_slice=1, has_batch_dim=False)
    assert ours.shape == theirs.shape == (last.shape[0],)
    torch.testing.assert_close(ours, theirs, atol=ATOL, rtol=0)


# -- 2. Gemma: hook_embed after the sqrt(d_model) scale -----------------------------------------
def test_gemma_hook_embed_is_the_scaled_embedding_as_in_transformer_lens():
    from transformer_lens import HookedTransformerConfig
    from transformer_lens.pretrained.weight_conversions.gemma import convert_gemma_weights
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    hf = Gemma3ForCausalLM(Gemma3TextConfig(
        vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        head_dim=16, intermediate_size=48, max_position_embeddings=64, sliding_window=4)).eval()
    tl_cfg = HookedTransformerConfig(
        d_model=32, d_head=16, n_heads=2, n_key_value_heads=1, d_mlp=48, n_layers=2, n_ctx=64, d_vocab=50,
        act_fn="gelu_pytorch_tanh", normalization_type="RMS", positional_embedding_type="rotary", gated_mlp=True,
        original_architecture="Gemma3ForCausalLM", dtype=torch.float32, device="cpu")
    w_e = convert_gemma_weights(hf, tl_cfg)["embed.W_E"].detach()  # TransformerLens folds the scale in here

    cfg = preset("gemma3-270m", vocab_size=50, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=16,
                 d_mlp=48, max_seq_len=64, sliding_window=4, global_layer_every=2, query_pre_attn_scalar=16.0)
    model = LanguageModel(cfg).eval()
    with torch.no_grad():
        model.embed.weight.copy_(hf.model.embed_tokens.weight)
    ids = torch.randint(1, 50, (1, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits, cache = run_with_cache(model, ids)
        plain = model(ids)
    torch.testing.assert_close(cache["hook_embed"], w_e[ids], atol=ATOL, rtol=0)  # TL's hook_embed
    torch.testing.assert_close(cache["hook_embed"], hf.model.embed_tokens(ids).detach(), atol=ATOL, rtol=0)
    torch.testing.assert_close(cache["hook_embed"], cache["resid_pre", 0], atol=0, rtol=0)
    torch.testing.assert_close(logits, plain, atol=1e-6, rtol=0)  # hooks change nothing
    for layer in (0, 1, 2):  # pre-norm: the decomposition adds up to the stream, embedding included
        stream = cache["resid_pre", layer] if layer < 2 else cache["resid_post", 1]
        torch.testing.assert_close(cache.decompose_resid(layer=layer).sum(0), stream, atol=1e-4, rtol=0)


# -- 3. the logit lens under a final-logit softcap -----------------------------------------------
def test_logit_lens_caps_every_row_like_the_model(tmp_path):
    from transformer_lens import HookedTransformer
    from transformer_lens.pretrained.weight_conversions import convert_llama_weights

    hf = tl_oracle.hf_model("llama")
    lucid = tl_oracle.lucid_model(hf, tmp_path)
    lucid.config.final_logit_softcap = 2.0
    tl_cfg = tl_oracle.tl_config("llama", hf)
    tl_cfg.output_logits_soft_cap = 2.0
    tl = HookedTransformer(tl_cfg)
    tl.load_and_process_state_dict(convert_llama_weights(hf, tl_cfg), fold_ln=False, center_writing_weights=False,
                                   center_unembed=False, fold_value_biases=False,
                                   refactor_factored_attn_matrices=False)
    ids = tl_oracle.ids(0, 1, 7)
    lens = logit_lens(lucid, ids, top_k=2)
    with torch.no_grad():
        tl_logits, tl_cache = tl.eval().run_with_cache(ids)
        stack = tl_cache.accumulated_resid(apply_ln=True)[:, 0]  # (L+1, T, d)
        capped = 2.0 * torch.tanh(tl.unembed(stack) / 2.0)
    top_probs, top_ids = torch.softmax(capped, -1).topk(2, dim=-1)
    torch.testing.assert_close(lens.top_probs, top_probs, atol=ATOL, rtol=0)
    assert torch.equal(lens.top_ids, top_ids)
    torch.testing.assert_close(lens.top_probs[-1, :, 0], torch.softmax(tl_logits[0], -1).max(-1).values,
                               atol=ATOL, rtol=0)  # the last row is the model's own prediction


# -- 4. incl_bwd on a padded batch of texts: padding left out of the default loss ---------------
def test_left_padded_text_batch_gradients_match_transformer_lens_loss(gpt2_bpe_pair):
    lucid, tl = gpt2_bpe_pair
    texts = ["Hello world, this is long", "A b"]
    names = ["hook_embed", "blocks.1.hook_resid_post", "blocks.0.attn.hook_z"]
    _, cache = run_with_cache(lucid, texts, prepend_bos=True, padding_side="left", incl_bwd=True, names_filter=names)
    lucid.zero_grad(set_to_none=True)
    loss, tl_cache = tl.run_with_cache(texts, prepend_bos=True, padding_side="left", return_type="loss",
                                      incl_bwd=True)
    tl.zero_grad(set_to_none=True)
    real = to_tokens(lucid, texts, prepend_bos=True, padding_side="left", return_attention_mask=True)[1].bool()
    assert not bool(real.all())  # the short text is padded
    for name in names:
        torch.testing.assert_close(cache[name + "_grad"][real], tl_cache[name + "_grad"][real], atol=1e-6, rtol=0)


# -- 5. a cache recorded with last_token_only ----------------------------------------------------
def test_last_token_only_cache_normalises_the_last_position_and_refuses_the_others(llama_pair):
    _, lucid, tl = llama_pair
    ids = tl_oracle.ids()
    with torch.no_grad():
        _, last = run_with_cache(lucid, ids, last_token_only=True)
        _, tl_cache = tl.run_with_cache(ids)
    assert last["ln_final.hook_scale"].shape[-2] == 1 < ids.shape[1]
    ours = last.decompose_resid(apply_ln=True, pos_slice=-1)
    theirs = tl_cache.decompose_resid(apply_ln=True, pos_slice=-1)
    torch.testing.assert_close(ours, theirs, atol=ATOL, rtol=0)
    stack = last.decompose_resid()
    torch.testing.assert_close(last.apply_ln_to_stack(stack, pos_slice=[-1]),
                               tl_cache.apply_ln_to_stack(stack, pos_slice=[-1]), atol=ATOL, rtol=0)
    for call in (lambda: last.decompose_resid(apply_ln=True), lambda: last.apply_ln_to_stack(stack),
                 lambda: last.logit_attrs(stack, 5)):
        with pytest.raises(InputError, match="last_token_only"):
            call()


# -- 6. attention patterns of a KV-cached decode step --------------------------------------------
def test_decode_step_pattern_is_the_row_over_the_written_slots(llama_pair, tmp_path):
    _, lucid, tl = llama_pair
    ids = tl_oracle.ids(0, 1, 9)
    T = ids.shape[1]
    lucid.setup_kv_cache(1, 32)
    try:
        with torch.no_grad():
            run_with_cache(lucid, ids[:, :-1], input_pos=torch.arange(T - 1))
            _, step = run_with_cache(lucid, ids[:, -1:], input_pos=torch.tensor([T - 1]))
    finally:
        lucid.clear_kv_cache()
    with torch.no_grad():
        _, tl_cache = tl.run_with_cache(ids)
    for layer, head in [(0, 0), (1, 3)]:
        got = attention_pattern(step, layer, head)  # (1, T): the new query over slots 0..T-1
        want = tl_cache["pattern", layer][0, head, -1:, :]
        assert got.shape == (1, T)
        torch.testing.assert_close(torch.from_numpy(got), want, atol=ATOL, rtol=0)
    fig = plot_attention(step, 1, 3, tokens=[str(i) for i in ids[0].tolist()])
    assert fig.axes[0].get_images()[0].get_array().shape == (1, T)
    with pytest.raises(InputError, match="input_pos"):
        attention_view(lucid, ids, cache=step)


# -- 7. a token given as text, on a tokenizer that puts BOS first --------------------------------
def test_logit_attrs_take_a_token_as_text_without_the_tokenizers_bos(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from lucidlm.inspect.resid import single_token
    from lucidlm.tokenizers.pretrained import HFTokenizer

    words = ["<unk>", "<s>", "</s>", "The", "capital", "of", "France", "is", "Paris", "Rome"]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True}))
    ours = HFTokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert ours.encode("Paris")[0] == ours.bos_id  # the tokenizer adds BOS by itself
    theirs = PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"), bos_token="<s>",
                                     eos_token="</s>", unk_token="<unk>")
    paris = theirs.encode("Paris", add_special_tokens=False)  # TransformerLens's to_single_token: no BOS
    assert len(paris) == 1
    torch.manual_seed(0)
    model = LanguageModel(preset("llama", vocab_size=len(words), d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                                 d_mlp=48, max_seq_len=64), ours).eval()
    assert single_token(model, "Paris") == paris[0]
    with torch.no_grad():
        _, cache = run_with_cache(model, "The capital of France is")
    stack = cache.decompose_resid(pos_slice=-1)
    torch.testing.assert_close(cache.logit_attrs(stack, "Paris", "Rome", pos_slice=-1),
                               cache.logit_attrs(stack, paris[0], theirs.convert_tokens_to_ids("Rome"), pos_slice=-1))
    with pytest.raises(InputError, match="2 tokens"):
        cache.logit_attrs(stack, "capital of", pos_slice=-1)


# -- 8. the logit lens of a list of texts ---------------------------------------------------------
def test_logit_lens_of_a_list_of_texts_reads_the_first(gpt2_bpe_pair):
    lucid, tl = gpt2_bpe_pair
    texts = ["Hi", "The capital of France is"]  # the first is the shorter: no padding may reach it
    lens = logit_lens(lucid, texts, top_k=1)
    tokens = tl.to_tokens(texts[0], prepend_bos=False)
    with torch.no_grad():
        _, tl_cache = tl.run_with_cache(tokens)
        probs = torch.softmax(tl.unembed(tl_cache.accumulated_resid(apply_ln=True)[:, 0]), -1)
    top_probs, top_ids = probs.topk(1, dim=-1)
    assert lens.input_tokens == tl.to_str_tokens(texts[0], prepend_bos=False)
    assert torch.equal(lens.top_ids, top_ids)
    torch.testing.assert_close(lens.top_probs, top_probs, atol=ATOL, rtol=0)


# -- 9. patching grouped key heads other than k / v -----------------------------------------------
def test_rot_k_patching_counts_key_value_heads(llama_pair):
    _, lucid, tl = llama_pair
    clean, corrupted = tl_oracle.ids(0, 1, 5), tl_oracle.ids(1, 1, 5)
    with torch.no_grad():
        _, cache = run_with_cache(lucid, clean)
        _, tl_clean = tl.run_with_cache(clean)
        _, tl_dirty = tl.run_with_cache(corrupted)
        base = metric(tl(corrupted))
    ours = patching.generic_activation_patch(lucid, corrupted, cache, metric,
                                             patching.layer_head_vector_patch_setter, "rot_k", ["layer", "head"])
    approx = patching.attribution_patch(lucid, cache, corrupted, metric, "rot_k", ["layer", "head"])
    assert ours.shape == approx.shape == (2, 2)  # n_kv_heads, not n_heads
    eps = 1e-3
    for layer in range(2):
        name = f"blocks.{layer}.attn.hook_rot_k"
        clean_k, dirty_k = tl_clean[name], tl_dirty[name]  # (1, T, n_kv, hd) in TransformerLens too
        for head in range(2):
            def patch(act, hook, head=head, step=1.0):
                act = act.clone()
                act[:, :, head] = dirty_k[:, :, head] + step * (clean_k[:, :, head] - dirty_k[:, :, head])
                return act
            with torch.no_grad():
                exact = metric(tl.run_with_hooks(corrupted, fwd_hooks=[(name, patch)]))
                nudged = metric(tl.run_with_hooks(corrupted, fwd_hooks=[(name, lambda a, hook, h=head: patch(
                    a, hook, h, eps))]))
            torch.testing.assert_close(ours[layer, head], exact, atol=1e-5, rtol=0)
            torch.testing.assert_close(approx[layer, head], (nudged - base) / eps, atol=2e-3, rtol=2e-2)


# -- 10. TransformerLens's shorthand aliases ------------------------------------------------------
def test_transformer_lens_shorthand_aliases(pair):
    cache, tl_cache = pair["cache"], pair["tl_cache"]
    for key in ["scale", "normalized", ("scale", None), ("attn_logits", 0), ("query", 0), ("key", 1),
                ("value", 0), ("embed", None), ("embed",)]:
        torch.testing.assert_close(cache[key], tl_cache[key], atol=ATOL, rtol=0, msg=str(key))
    with pytest.raises(HookError, match="not per layer"):
        cache["embed", 0]
    with pytest.raises(HookError, match=r"unknown short name 'patern'\. Did you mean 'pattern'") as error:
        cache["patern", 0]
    assert "hook points" not in str(error.value)  # it lists short names, not the model's hook count
