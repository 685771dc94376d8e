"""Activation-patching sweeps equal transformer_lens.patching's on the same weights; their
heatmaps draw; mismatched prompts are refused; attribution patching agrees with exact
patching where it should."""

from __future__ import annotations

import pytest
import torch

import lucidlm.inspect.patching as patching
from lucidlm.errors import InputError
from lucidlm.inspect import run_with_cache
from lucidlm.inspect.patching_plots import plot_patching_every, plot_patching_layer_head, plot_patching_layer_pos

tl_patching = pytest.importorskip("transformer_lens.patching")
import tl_oracle  # noqa: E402

# A few cells each (TransformerLens runs one forward per cell); k covers grouped key heads.
SWEEPS = ["get_act_patch_resid_pre", "get_act_patch_attn_head_out_all_pos", "get_act_patch_attn_head_k_all_pos",
          "get_act_patch_attn_head_pattern_all_pos", "get_act_patch_mlp_out"]


def metric(logits):
    return logits[0, -1, 5] - logits[0, -1, 9]


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def setup(request, tmp_path_factory):
    hf = tl_oracle.hf_model(request.param)
    lucid = tl_oracle.lucid_model(hf, tmp_path_factory.mktemp(request.param))
    tl = tl_oracle.tl_model(request.param, hf)
    clean, corrupted = tl_oracle.ids(0, 1, 5), tl_oracle.ids(1, 1, 5)
    with torch.no_grad():
        _, cache = run_with_cache(lucid, clean)
        _, tl_cache = tl.run_with_cache(clean)
    return lucid, tl, corrupted, cache, tl_cache


@pytest.mark.parametrize("sweep", SWEEPS)
def test_sweep_equals_transformer_lens(setup, sweep):
    lucid, tl, corrupted, cache, tl_cache = setup
    ours = getattr(patching, sweep)(lucid, corrupted, cache, metric)
    theirs = getattr(tl_patching, sweep)(tl, corrupted, tl_cache, metric)
    assert ours.shape == theirs.shape
    assert ours.std() > 1e-3  # the patches do something different from cell to cell
    torch.testing.assert_close(ours, theirs.cpu(), atol=1e-5, rtol=0)


def test_every_head_sweep_pads_grouped_key_heads_like_transformer_lens(setup):
    lucid, tl, corrupted, cache, tl_cache = setup
    if lucid.config.n_kv_heads == lucid.config.n_heads:
        return  # the padding is for grouped heads; the llama case runs it
    ours = patching.get_act_patch_attn_head_all_pos_every(lucid, corrupted, cache, metric)
    theirs = tl_patching.get_act_patch_attn_head_all_pos_every(tl, corrupted, tl_cache, metric)
    assert ours.shape == (5, 2, 4)
    torch.testing.assert_close(ours, theirs.cpu(), atol=1e-5, rtol=0)


def test_attribution_is_the_gradient_estimate(setup):
    """At a tiny step the estimate is exact: patching in corrupted + eps * (clean - corrupted)
    changes the metric by eps * attribution."""
    lucid, _, corrupted, cache, _ = setup
    approx = patching.attr_patch_resid_pre(lucid, cache, corrupted, metric)  # (layers, pos)
    _, corrupted_cache = run_with_cache(lucid, corrupted)
    eps = 1e-3
    with torch.no_grad():
        base = metric(lucid(corrupted))
        for layer, pos in [(0, 2), (1, 4)]:
            name = f"blocks.{layer}.hook_resid_pre"
            clean, dirty = cache[name], corrupted_cache[name]

            def nudge(act, hook):
                act = act.clone()
                act[:, pos] = dirty[:, pos] + eps * (clean[:, pos] - dirty[:, pos])
                return act
            from lucidlm.inspect import run_with_hooks
            moved = (metric(run_with_hooks(lucid, corrupted, fwd_hooks=[(name, nudge)])) - base) / eps
            torch.testing.assert_close(approx[layer, pos], moved, atol=2e-3, rtol=2e-2)


def test_plots_draw_every_sweep(setup, tmp_path):
    lucid, _, corrupted, cache, _ = setup
    grid = patching.get_act_patch_resid_pre(lucid, corrupted, cache, metric)
    fig = plot_patching_layer_pos(grid, tokens=[f"t{i}" for i in range(5)], path=tmp_path / "resid")
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()] == [f"t{i}" for i in range(5)]
    image = fig.axes[0].images[0]
    assert image.get_array().shape == (2, 5) and image.norm.vmin == -image.norm.vmax  # centred on zero
    assert (tmp_path / "resid.png").stat().st_size > 1000
    heads = patching.get_act_patch_attn_head_out_all_pos(lucid, corrupted, cache, metric)
    assert plot_patching_layer_head(heads).axes[0].images[0].get_array().shape == (2, 4)
    every = torch.randn(5, 2, 4)
    assert len(plot_patching_every(every).axes) == 5 + 1  # five panels and the colour bar
    with pytest.raises(InputError, match="3 token labels for patching results over 5 positions"):
        plot_patching_layer_pos(grid, tokens=["a", "b", "c"])


def test_prompts_of_different_lengths_are_refused(setup):
    lucid, _, _, cache, _ = setup
    with pytest.raises(InputError, match=r"'blocks\.0\.hook_resid_pre'.*1 sequence\(s\) of 5 tokens.*\(1, 7\)"):
        patching.get_act_patch_resid_pre(lucid, tl_oracle.ids(2, 1, 7), cache, metric)
    with pytest.raises(InputError, match=r"hook_z.*\(1, 3\)"):
        patching.attr_patch_attn_head_out_all_pos(lucid, cache, tl_oracle.ids(2, 1, 3), metric)
