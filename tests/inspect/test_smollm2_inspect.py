"""Inspection on the real pretrained SmolLM2-135M-Instruct: activation patching finds where
"France -> Paris" lives, and the HTML report renders for a 30-layer model."""

import re

import numpy as np
import pytest
import torch

from lucidlm.inspect import logit_lens, run_with_cache, run_with_hooks, write_report

pytestmark = pytest.mark.slow

CLEAN, CORRUPT = "The capital of France is", "The capital of Italy is"
SUBJECT_POS = 3  # " France" / " Italy"


@pytest.fixture(scope="module")
def prompts(smollm2):
    tok = smollm2.tokenizer
    clean, corrupt = torch.tensor([tok.encode(CLEAN)]), torch.tensor([tok.encode(CORRUPT)])
    assert clean.shape == corrupt.shape == (1, 5)  # the two prompts line up token by token
    assert tok.id_to_token(int(clean[0, SUBJECT_POS])) == " France"
    (paris,) = tok.encode(" Paris")
    with torch.no_grad():
        _, clean_cache = run_with_cache(smollm2, clean, names_filter=lambda n: n.endswith("hook_resid_post"))
    return clean, corrupt, paris, clean_cache


def _paris_after_patch(model, prompts, layer, position):
    """Run the corrupt prompt with the clean residual stream written in at (layer, position)."""
    clean, corrupt, paris, clean_cache = prompts
    source = clean_cache["resid_post", layer]

    def patch(resid, hook):
        resid = resid.clone()
        resid[:, position] = source[:, position]
        return resid

    with torch.no_grad():
        logits = run_with_hooks(model, corrupt, fwd_hooks=[(f"blocks.{layer}.hook_resid_post", patch)])
    probs = torch.softmax(logits[0, -1], dim=-1)
    return float(probs[paris]), int(probs.argmax())


def test_patching_shows_where_the_capital_is_looked_up(smollm2, prompts):
    clean, corrupt, paris, _ = prompts
    with torch.no_grad():
        p_clean = torch.softmax(smollm2(clean)[0, -1], -1)
        p_corrupt = torch.softmax(smollm2(corrupt)[0, -1], -1)
    assert int(p_clean.argmax()) == paris and p_clean[paris] > 0.5
    assert p_corrupt[paris] < 0.01  # for Italy the model does not say Paris

    # At the last position, the clean residual stream carries "Paris" only from block 23 on:
    # before that the answer has not yet been moved there from the subject token.
    p, top = _paris_after_patch(smollm2, prompts, layer=23, position=-1)
    assert p > 0.5 and top == paris
    p, top = _paris_after_patch(smollm2, prompts, layer=12, position=-1)
    assert p < 0.01 and top != paris
    # At the subject token it is the other way round: a middle layer's state there decides the
    # answer, and after block 23 that position no longer matters.
    p, top = _paris_after_patch(smollm2, prompts, layer=12, position=SUBJECT_POS)
    assert p > 0.5 and top == paris
    p, top = _paris_after_patch(smollm2, prompts, layer=24, position=SUBJECT_POS)
    assert p < 0.01 and top != paris


def test_kv_cache_decode_step_caches_what_a_full_forward_does(smollm2, prompts):
    clean = prompts[0]
    names = ["blocks.29.hook_resid_post", "blocks.14.attn.hook_pattern", "blocks.3.mlp.hook_post"]
    with torch.no_grad():
        _, full = run_with_cache(smollm2, clean, names_filter=names)
        smollm2.setup_kv_cache(1, 16)
        try:
            run_with_cache(smollm2, clean[:, :4], names_filter=names, input_pos=torch.arange(4))
            _, step = run_with_cache(smollm2, clean[:, 4:], names_filter=names, input_pos=torch.tensor([4]))
        finally:
            smollm2.clear_kv_cache()
    torch.testing.assert_close(step[names[0]], full[names[0]][:, 4:], atol=1e-4, rtol=1e-4)
    # The pattern spans the whole 16-slot cache; slots after the step's own are masked (0).
    assert (step[names[1]][..., 5:] == 0).all()
    torch.testing.assert_close(step[names[1]][..., :5], full[names[1]][:, :, 4:], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(step[names[2]], full[names[2]][:, 4:], atol=1e-4, rtol=1e-4)


def test_logit_lens_ends_on_paris(smollm2, prompts):
    lens = logit_lens(smollm2, CLEAN, top_k=1)
    assert lens.input_tokens == ["The", " capital", " of", " France", " is"]
    assert lens.top_tokens[-1][-1][0] == " Paris"
    assert lens.top_tokens[1][-1][0] != " Paris"  # not known after the first block


def test_report_for_smollm2_renders(smollm2, chromium, tmp_path):
    path = write_report(smollm2, CLEAN, tmp_path / "smollm2.html")
    dom = chromium.dump_dom(f"{path.as_uri()}#layer=20&head=8")
    assert len(re.findall(r'class="token( selected)?"', dom)) == 5
    assert dom.count('class="cell"') == 25
    assert 'data-layer="20"' in dom and 'data-head="8"' in dom
    assert dom.count('class="mono lens-cell"') == 31 * 5
    shot = chromium.screenshot(path.as_uri(), tmp_path / "shot.png")
    from PIL import Image
    pixels = np.asarray(Image.open(shot).convert("RGB"))
    assert len(np.unique(pixels.reshape(-1, 3), axis=0)) > 50
