"""Inline views: self-contained HTML with ids of their own, several of which work on one page."""

import re

import torch

from lucidlm.inspect import logit_lens, run_with_cache
from lucidlm.inspect.views import attention_view

TEXT = "Hello there"


def test_attention_view_carries_every_pattern_and_no_network(tiny_model):
    view = attention_view(tiny_model, TEXT)
    html = view._repr_html_()
    assert "http" not in html and "<link" not in html and "src=" not in html  # nothing fetched
    _, cache = run_with_cache(tiny_model, TEXT)
    assert view.patterns.shape == (2, 4, len(TEXT), len(TEXT))
    torch.testing.assert_close(view.patterns[1], cache["pattern", 1][0])
    other = attention_view(tiny_model, TEXT)._repr_html_()
    ids = re.findall(r'id="(lucidlm-attn-[0-9a-f]+)"', html + other)
    assert len(ids) == 2 and ids[0] != ids[1]  # one element id per view
    assert all(rule.startswith(f"#{ids[0]}") for rule in re.findall(r"^(#\S+)", html, re.M))  # CSS scoped


def test_two_views_on_one_page_both_draw(tiny_model, chromium, tmp_path):
    page = tmp_path / "views.html"
    views = attention_view(tiny_model, TEXT)._repr_html_() + attention_view(tiny_model, "Hi")._repr_html_()
    page.write_text(f"<html><body>{views}</body></html>", encoding="utf-8")
    dom = chromium.dump_dom(page.as_uri())
    assert dom.count('class="cell"') == len(TEXT) ** 2 + 2 ** 2  # each grid drawn by its own script
    assert dom.count("<option") == 2 * (2 + 4)  # each view's layer and head pickers


def test_logit_lens_displays_as_a_table(tiny_model):
    lens = logit_lens(tiny_model, TEXT)
    html = lens._repr_html_()
    assert html.count("<tr>") == 1 + len(lens.layer_labels)
    assert html.count("<td") == len(lens.layer_labels) * len(TEXT)
    assert lens.top_tokens[-1][0][0] in html
