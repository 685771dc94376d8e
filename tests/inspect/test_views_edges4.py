"""Edges of the presentation layer (lens, attention view, plots, loss curves, report) found in
the fourth bug hunt, each checked against TransformerLens 3.9, NumPy, matplotlib or the
standard library on the same inputs: a cache handed in with a text it was not made of, the
attention view of a list of texts, NaN and inf in patching results, dotted figure names,
numpy and 0-d tensor indices, a torn metrics.jsonl, and a list given to the report."""

from __future__ import annotations

import json

import matplotlib
import numpy as np
import pytest
import torch

from lucidlm.errors import HookError, InputError
from lucidlm.inspect import attention_view, build_report, logit_lens, run_with_cache, write_report
from lucidlm.inspect.loss_plot import plot_loss_curves, read_metrics
from lucidlm.inspect.patching_plots import plot_patching_every, plot_patching_layer_head, plot_patching_layer_pos
from lucidlm.inspect.plots import attention_pattern, plot_attention, save_figure

pytest.importorskip("transformer_lens")
import tl_oracle  # noqa: E402  (a helper beside this file)
from test_lens_edges import gpt2_bpe_pair  # noqa: E402,F401  (the fixture: GPT-2's real tokenizer, lucidlm and TL)

ATOL = 1e-5


@pytest.fixture(scope="module")
def gpt2_ids_pair(tmp_path_factory):
    hf = tl_oracle.hf_model("gpt2")
    lucid = tl_oracle.lucid_model(hf, tmp_path_factory.mktemp("gpt2"))
    tl = tl_oracle.tl_model("gpt2", hf)
    ids = tl_oracle.ids(batch=1)  # (1, 9)
    with torch.no_grad():
        _, cache = run_with_cache(lucid, ids)
        _, tl_cache = tl.run_with_cache(ids)
    return lucid, cache, tl_cache


# -- 1. a cache handed in with a text it was not made of -----------------------------------------
def test_lens_and_view_refuse_the_cache_of_a_padded_batch_or_another_text(gpt2_bpe_pair):
    lucid, tl = gpt2_bpe_pair
    texts = ["Hi", "Hello world, how are you"]
    padded = len(tl.to_str_tokens(texts[1], prepend_bos=False))  # the batch's width: its longest text
    first = len(tl.to_str_tokens(texts[0], prepend_bos=False))
    wrong = f"the cache holds {padded} positions, but the text has {first} token"
    _, batch_cache = run_with_cache(lucid, texts, padding_side="left")
    with pytest.raises(InputError, match=f"logit_lens: {wrong}"):
        logit_lens(lucid, texts, cache=batch_cache)
    with pytest.raises(InputError, match=f"attention_view: {wrong}"):
        attention_view(lucid, texts, cache=batch_cache)
    _, other = run_with_cache(lucid, texts[1])
    with pytest.raises(InputError, match=wrong):
        attention_view(lucid, texts[0], cache=other)
    with pytest.raises(InputError, match=wrong):
        logit_lens(lucid, texts[0], cache=other)


def test_a_batch_cache_whose_first_row_is_unpadded_is_read_as_that_text(gpt2_bpe_pair):
    lucid, tl = gpt2_bpe_pair
    texts = ["Hello world, how are you", "Hi"]  # the first is the longest: its row has no padding
    _, batch_cache = run_with_cache(lucid, texts, padding_side="left")
    view = attention_view(lucid, texts, cache=batch_cache)
    lens = logit_lens(lucid, texts, cache=batch_cache)
    with torch.no_grad():
        _, tl_cache = tl.run_with_cache(tl.to_tokens(texts[0], prepend_bos=False))
        probs = torch.softmax(tl.unembed(tl_cache.accumulated_resid(apply_ln=True)[:, 0]), -1)
    assert view.tokens == lens.input_tokens == tl.to_str_tokens(texts[0], prepend_bos=False)
    for layer in range(2):
        torch.testing.assert_close(view.patterns[layer], tl_cache["pattern", layer][0], atol=ATOL, rtol=0)
    assert torch.equal(lens.top_ids[..., 0], probs.argmax(-1))


# -- 2. the attention view of a list of texts: the first, alone -----------------------------------
def test_attention_view_of_a_list_of_texts_shows_the_first_unpadded(gpt2_bpe_pair):
    lucid, tl = gpt2_bpe_pair
    texts = ["Hi there", "Hello world, how are you today"]
    view = attention_view(lucid, texts)
    with torch.no_grad():
        _, tl_cache = tl.run_with_cache(tl.to_tokens(texts[0], prepend_bos=False))
    assert view.tokens == tl.to_str_tokens(texts[0], prepend_bos=False)
    assert tuple(view.patterns.shape) == (2, *tl_cache["pattern", 0][0].shape)
    for layer in range(2):
        torch.testing.assert_close(view.patterns[layer], tl_cache["pattern", layer][0], atol=ATOL, rtol=0)


# -- 3. NaN and inf in patching results keep the others' colour scale -----------------------------
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_patching_colour_scale_comes_from_the_finite_cells(bad):
    results = torch.tensor([[bad, 1.0, 0.5], [0.25, -0.2, 0.0]])
    values = results.numpy()
    limit = np.abs(values[np.isfinite(values)]).max()  # NumPy's: 1.0
    cmap = matplotlib.colormaps["RdBu_r"]
    norm = matplotlib.colors.Normalize(-limit, limit)
    figures = (plot_patching_layer_pos(results), plot_patching_layer_head(results),
               plot_patching_every(results[None], panel_titles=["z"]))
    for fig in figures:
        image = fig.axes[0].images[0]
        assert (image.norm.vmin, image.norm.vmax) == (-limit, limit)
        rgba = image.to_rgba(image.get_array())
        for col in (1, 2):  # 1.0 and 0.5 in their own colours, as matplotlib maps them on [-1, 1]
            np.testing.assert_allclose(rgba[0, col], cmap(norm(values[0, col])))


def test_patching_colour_scale_of_all_nan_or_zero_results_is_unit():
    for results in (torch.full((2, 3), float("nan")), torch.zeros(2, 3)):
        image = plot_patching_layer_head(results).axes[0].images[0]
        assert (image.norm.vmin, image.norm.vmax) == (-1.0, 1.0)


# -- 4. save_figure appends the suffixes -------------------------------------------------------------
def test_save_figure_keeps_dots_in_the_name(tmp_path):
    from matplotlib.figure import Figure

    fig = Figure()
    fig.subplots().plot([0, 1])
    assert save_figure(fig, tmp_path / "L0.H1") == [tmp_path / "L0.H1.png", tmp_path / "L0.H1.svg"]
    assert save_figure(fig, str(tmp_path / "run.v2" / "loss.png")) == [tmp_path / "run.v2" / "loss.png",
                                                                          tmp_path / "run.v2" / "loss.svg"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["L0.H1.png", "L0.H1.svg", "run.v2"]
    assert (tmp_path / "L0.H1.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plotting_heads_under_dotted_names_writes_one_file_pair_each(gpt2_ids_pair, tmp_path):
    _, cache, _ = gpt2_ids_pair
    for head in range(4):
        plot_attention(cache, 0, head, path=tmp_path / f"L0.H{head}")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f"L0.H{h}{s}" for h in range(4)
                                                                for s in (".png", ".svg"))


# -- 5. numpy and 0-d tensor indices, as argmax over patching results gives them -----------------------
def test_numpy_and_tensor_indices_read_what_transformer_lens_reads(gpt2_ids_pair):
    _, cache, tl_cache = gpt2_ids_pair
    results = torch.zeros(2, 4)
    results[1, 2] = 1.0
    layer, head = np.unravel_index(int(results.argmax()), results.shape)  # np.int64(1), np.int64(2)
    want = tl_cache["pattern", layer][0, head]
    torch.testing.assert_close(cache["pattern", layer][0, head], want, atol=ATOL, rtol=0)
    for args in ((layer, head), (1, head), (torch.tensor(1), results[1].argmax()), (np.int32(-1), np.int8(2))):
        torch.testing.assert_close(torch.as_tensor(attention_pattern(cache, *args)), want, atol=ATOL, rtol=0)
    torch.testing.assert_close(cache.accumulated_resid(layer=np.int64(1)), tl_cache.accumulated_resid(layer=1),
                               atol=ATOL, rtol=0)
    fig = plot_attention(cache, np.int64(1), torch.tensor(2))
    assert fig.axes[0].get_title() == "Attention pattern, layer 1, head 2"


def test_bools_and_floats_are_not_indices(gpt2_ids_pair):
    _, cache, _ = gpt2_ids_pair
    with pytest.raises(HookError, match="not a whole number"):
        cache["pattern", True]
    with pytest.raises(HookError, match="not a whole number"):
        cache["pattern", 1.0]
    with pytest.raises(HookError, match="not a head index"):
        attention_pattern(cache, 0, True)
    with pytest.raises(HookError, match="not a head index"):
        attention_pattern(cache, 0, torch.tensor(True))
    with pytest.raises(HookError, match="not a layer index"):
        attention_pattern(cache, np.float64(1.0), 0)
    with pytest.raises(HookError, match="not a layer index"):
        cache.accumulated_resid(layer=True)


# -- 6. a torn metrics.jsonl and the smoothing weight ----------------------------------------------
def test_read_metrics_drops_the_torn_last_line_of_a_killed_run(tmp_path, capsys):
    lines = [json.dumps({"step": 10, "train_loss": 3.0, "val_loss": 3.1}),
             json.dumps({"step": 20, "train_loss": 2.5, "val_loss": 2.75})]
    path = tmp_path / "metrics.jsonl"
    path.write_text("\n".join(lines) + "\n" + '{"step": 30, "train_lo')  # killed mid-line
    assert read_metrics(path) == [json.loads(line) for line in lines]
    assert "dropped 1 torn line(s) (line 3)" in capsys.readouterr().out
    assert plot_loss_curves(path, tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("smoothing", [1.0, 1.5, -0.1, float("nan"), True])
def test_plot_loss_curves_refuses_a_smoothing_outside_zero_to_one(tmp_path, smoothing):
    record = {"step": 10, "train_loss": 3.0, "val_loss": 3.1}
    with pytest.raises(InputError, match="smoothing="):
        plot_loss_curves([record], tmp_path / "loss.png", step_losses=[3.0, 2.5], smoothing=smoothing)
    assert not (tmp_path / "loss.png").exists()


# -- 7. the report takes one text ---------------------------------------------------------------------
@pytest.mark.parametrize("arg", [["Hi", "there"], [3, 4, 5]])
def test_report_of_a_list_says_it_takes_one_text(gpt2_bpe_pair, tmp_path, arg):
    lucid, _ = gpt2_bpe_pair
    with pytest.raises(InputError, match=r"the report takes one text \(a str\), got a list"):
        build_report(lucid, arg)
    with pytest.raises(InputError, match=r"the report takes one text \(a str\), got a list"):
        write_report(lucid, arg, tmp_path / "report.html")
