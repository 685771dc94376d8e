"""Jupyter displays: ``ActivationCache`` as a table of its hooks, ``AttentionView`` under a
fresh element id per render, and every display's CSS scoped to its own element."""

from __future__ import annotations

import html

import torch

from html_checks import assert_css_scoped, element_ids

from lucidlm.inspect import attention_view, logit_lens
from lucidlm.inspect.activation_cache import ActivationCache


def first_id(page: str) -> str:
    return element_ids(page)[0]


def test_scoped_style_prefixes_every_selector():
    from lucidlm.display import scoped_style
    css = scoped_style("v1", {"": "color: red", "td, th": "padding: 0", ".a .b": "margin: 0"})
    assert "#v1 {color: red}" in css and "#v1 td, #v1 th {padding: 0}" in css and "#v1 .a .b {margin: 0}" in css
    assert_css_scoped(css, "v1")


def test_attention_view_gets_a_fresh_id_on_every_render(tiny_model):
    view = attention_view(tiny_model, "hello")
    first, second = view._repr_html_(), view._repr_html_()
    id1, id2 = first_id(first), first_id(second)
    assert id1 != id2
    assert first.count(id1) > 1 and id1 not in second  # the script finds its element by the same id
    assert_css_scoped(first, id1)


def test_logit_lens_css_is_scoped(tiny_model):
    page = logit_lens(tiny_model, "hello")._repr_html_()
    assert_css_scoped(page, first_id(page))


def test_cache_html_lists_every_hook_with_shape_and_dtype(tiny_model):
    _, cache = tiny_model.run_with_cache("hello")
    page = cache._repr_html_()
    view_id = first_id(page)
    assert view_id.startswith("lucidlm-cache-") and view_id != first_id(cache._repr_html_())
    assert_css_scoped(page, view_id)
    assert f"{len(cache)} activations" in page and "with a batch dim" in page
    for name, act in cache.items():
        assert f"<tr><td>{html.escape(name)}</td><td>{tuple(act.shape)}</td>" in page
        assert str(act.dtype).removeprefix("torch.") in page
    assert page.count("<tr><td>") == len(cache)
    single = cache.remove_batch_dim()._repr_html_()
    assert "batch dim removed" in single
    assert f"<td>{tuple(cache['embed'].shape[1:])}</td>" in single


def test_cache_html_escapes_hook_names(tiny_model):
    cache = ActivationCache({"<script>&'\"": torch.zeros(2, 3, dtype=torch.float16)}, tiny_model)
    page = cache._repr_html_()
    assert "<script>" not in page
    assert "<td>&lt;script&gt;&amp;&#x27;&quot;</td><td>(2, 3)</td><td>float16</td>" in page


def test_cache_repr_is_plain_and_short(tiny_model):
    _, cache = tiny_model.run_with_cache("hello")
    text = repr(cache)
    assert text.startswith(f"ActivationCache({len(cache)} activations") and text.endswith(", ...)")
    small = ActivationCache({"a": torch.zeros(1)}, tiny_model, has_batch_dim=False)
    assert repr(small) == "ActivationCache(1 activation, batch dim removed: a)"
