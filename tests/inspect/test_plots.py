"""Plots: the right numbers in the image, files written as PNG and SVG, clear range errors."""

import numpy as np
import pytest
from PIL import Image

from lucidlm.errors import HookError
from lucidlm.inspect import (logit_lens, plot_attention, plot_attention_heads, plot_logit_lens,
                             plot_position_encodings, plot_rope_angles, run_with_cache, to_str_tokens)

TEXT = "Hello there"


def _distinct_colours(png_path):
    pixels = np.asarray(Image.open(png_path).convert("RGB")).reshape(-1, 3)
    return len(np.unique(pixels, axis=0))


def _image_data(fig, index=0):
    return np.asarray(fig.axes[0].images[index].get_array())


def test_attention_heatmap_shows_the_cached_pattern_and_saves_png_and_svg(tiny_model, tmp_path):
    _, cache = run_with_cache(tiny_model, TEXT)
    tokens = to_str_tokens(tiny_model, TEXT)
    fig = plot_attention(cache, layer=1, head=2, tokens=tokens, path=tmp_path / "attn")
    np.testing.assert_allclose(_image_data(fig), cache["pattern", 1][0, 2].numpy())
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["H", "e", "l", "l", "o", "·", "t", "h", "e", "r", "e"]
    assert len(ax.get_yticklabels()) == len(tokens)
    assert _distinct_colours(tmp_path / "attn.png") > 20
    assert (tmp_path / "attn.svg").read_text().lstrip().startswith("<?xml")
    # A bare pattern tensor works too, with or without the batch dimension.
    fig2 = plot_attention(cache["pattern", 1][0], layer=1, head=-1)
    np.testing.assert_allclose(_image_data(fig2), cache["pattern", 1][0, -1].numpy())


def test_attention_heads_grid_has_one_panel_per_head(tiny_model, tmp_path):
    _, cache = run_with_cache(tiny_model, TEXT)
    fig = plot_attention_heads(cache, 0, to_str_tokens(tiny_model, TEXT), path=tmp_path / "heads")
    panels = [ax for ax in fig.axes if ax.images]
    assert len(panels) == tiny_model.config.n_heads
    for head, ax in enumerate(panels):
        np.testing.assert_allclose(np.asarray(ax.images[0].get_array()), cache["pattern", 0][0, head].numpy())
    assert (tmp_path / "heads.png").is_file() and (tmp_path / "heads.svg").is_file()


def test_layer_and_head_out_of_range(tiny_model):
    _, cache = run_with_cache(tiny_model, TEXT)
    with pytest.raises(HookError, match=r"layer=5 is out of range: this model has 2 layers \(0\.\.1\)"):
        plot_attention(cache, 5, 0)
    with pytest.raises(HookError, match=r"head=4 is out of range: layer 0 has 4 heads \(0\.\.3\)"):
        plot_attention(cache, 0, 4)
    with pytest.raises(HookError, match="token labels"):
        plot_attention(cache, 0, 0, tokens=["a", "b"])
    with pytest.raises(HookError, match="out of range"):
        plot_attention_heads(cache, -3)


def test_position_encodings_plot_the_sinusoid_table(tmp_path):
    fig = plot_position_encodings(max_seq_len=16, d_model=32, path=tmp_path / "pos")
    # "Attention is all you need": PE(p, 2i) = sin(p / 10000^(2i/d)), PE(p, 2i+1) = cos(same).
    p = np.arange(16)[:, None]
    angle = p / 10000 ** (np.arange(0, 32, 2) / 32)
    expected = np.empty((16, 32))
    expected[:, 0::2], expected[:, 1::2] = np.sin(angle), np.cos(angle)
    np.testing.assert_allclose(_image_data(fig), expected, atol=1e-6)
    assert _distinct_colours(tmp_path / "pos.png") > 20


def test_rope_angles_plot(tmp_path):
    fig = plot_rope_angles(head_dim=16, max_seq_len=32, theta=500.0, path=tmp_path / "rope")
    m = np.arange(32)[:, None]
    expected = np.cos(m * 500.0 ** (-np.arange(0, 16, 2) / 16))
    np.testing.assert_allclose(_image_data(fig), expected, atol=1e-12)
    wavelengths = fig.axes[1].lines[0].get_ydata()
    np.testing.assert_allclose(wavelengths, 2 * np.pi * 500.0 ** (np.arange(0, 16, 2) / 16))
    assert _distinct_colours(tmp_path / "rope.png") > 20


def test_logit_lens_plot(tiny_model, tmp_path):
    lens = logit_lens(tiny_model, TEXT)
    fig = plot_logit_lens(lens, path=tmp_path / "lens")
    np.testing.assert_allclose(_image_data(fig), lens.top_probs[:, :, 0].numpy())
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == ["embed", "0", "1"]
    assert (tmp_path / "lens.svg").is_file()
