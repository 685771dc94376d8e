"""The logit lens reads each layer's residual stream through the final norm and unembedding."""

import torch

from lucidlm.inspect import logit_lens, run_with_cache

TEXT = "To be, or not"


def _manual_lens_logits(model, ids, after_blocks):
    """Embed, run the first ``after_blocks`` blocks by hand, then norm + unembed."""
    T = ids.shape[1]
    positions = torch.arange(T)[None]
    x = model.embed(ids)
    if model.pos_embed is not None:
        x = x + model.pos_embed(positions)
    rope = model.rotary.cos_sin(positions, x.dtype) if model.rotary is not None else None
    for block in model.blocks[:after_blocks]:
        x = block(x, rope)
    if model.ln_final is not None:
        x = model.ln_final(x)
    return model.unembed(x)[0]  # (T, V)


def test_every_row_matches_a_model_stopped_after_that_block(family_model):
    model = family_model
    ids = torch.tensor([model.tokenizer.encode(TEXT)])
    lens = logit_lens(model, ids, top_k=3)
    n_layers = model.config.n_layers
    assert lens.layer_labels == ["embed"] + [str(i) for i in range(n_layers)]
    assert lens.input_tokens == list(TEXT)
    assert lens.top_ids.shape == (n_layers + 1, len(TEXT), 3)
    with torch.no_grad():
        for row in range(n_layers + 1):
            probs = torch.softmax(_manual_lens_logits(model, ids, row), dim=-1)
            top = probs.topk(3, dim=-1)
            torch.testing.assert_close(lens.top_probs[row], top.values, atol=1e-5, rtol=1e-4)
            assert torch.equal(lens.top_ids[row], top.indices)
        final = torch.softmax(model(ids)[0], dim=-1)  # the last row is the model's own prediction
    torch.testing.assert_close(lens.top_probs[-1, :, 0], final.max(-1).values, atol=1e-5, rtol=1e-4)
    assert lens.top_tokens[-1][2][0] == model.tokenizer.id_to_token(int(final[2].argmax()))


def test_accumulated_resid_stacks_embeddings_then_each_block(tiny_model):
    _, cache = run_with_cache(tiny_model, TEXT)
    stack, labels = cache.accumulated_resid(return_labels=True)
    assert labels == ["0_pre", "1_pre", "final_post"]  # TransformerLens's labels
    assert torch.equal(stack[0], cache["resid_pre", 0])
    assert torch.equal(stack[2], cache["resid_post", 1])
    with_mid, labels = cache.accumulated_resid(layer=1, incl_mid=True, return_labels=True)
    assert labels == ["0_pre", "0_mid", "1_pre"] and with_mid.shape[0] == 3
    normed = cache.accumulated_resid(apply_ln=True)
    torch.testing.assert_close(normed[1], tiny_model.ln_final(cache["resid_post", 0]))


def test_text_input_and_format(tiny_model):
    lens = logit_lens(tiny_model, TEXT)
    text = lens.format()
    lines = text.splitlines()
    assert len(lines) == 1 + tiny_model.config.n_layers + 1
    assert lines[-1].split()[0] == "1"
    table = lens.table()
    assert len(table) == 3 and len(table[0]) == len(TEXT)
    assert all(0.0 < p <= 1.0 for row in table for _, p in row)
