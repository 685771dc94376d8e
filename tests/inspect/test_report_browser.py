"""The HTML report in a real browser (headless Chromium): it renders, its script runs, and
picking a layer/head (through the page's #layer=&head= link form) draws that map."""

from html.parser import HTMLParser

import numpy as np
import pytest
from PIL import Image

from lucidlm.inspect import run_with_cache, write_report

TEXT = "To be, or not to be!"
VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"}


class ElementCollector(HTMLParser):
    """Every element as (tag, attrs, id of the nearest ancestor that has one)."""

    def __init__(self) -> None:
        super().__init__()
        self.elements, self.stack = [], []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        container = next((a for a in reversed(self.stack) if a), None)
        self.elements.append((tag, attrs, container))
        if tag not in VOID:
            self.stack.append(attrs.get("id"))

    def handle_startendtag(self, tag, attrs):
        self.elements.append((tag, dict(attrs), next((a for a in reversed(self.stack) if a), None)))

    def handle_endtag(self, tag):
        if tag not in VOID and self.stack:
            self.stack.pop()

    def within(self, container, tag=None, cls=None):
        return [attrs for t, attrs, c in self.elements if c == container and (tag is None or t == tag)
                and (cls is None or cls in attrs.get("class", "").split())]


def _parse(dom):
    collector = ElementCollector()
    collector.feed(dom)
    return collector


@pytest.fixture(scope="module")
def report(make_model, tmp_path_factory):
    model = make_model("gpt2", n_layers=3)
    path = write_report(model, TEXT, tmp_path_factory.mktemp("report") / "report.html", top_k=5)
    return model, path


def test_report_screenshot_is_not_blank(chromium, report, tmp_path):
    _, path = report
    shot = chromium.screenshot(path.as_uri(), tmp_path / "shot.png")
    pixels = np.asarray(Image.open(shot).convert("RGB"))
    assert pixels.shape[:2] == (900, 1200)
    colours = np.unique(pixels.reshape(-1, 3), axis=0)
    assert len(colours) > 50
    not_white = (pixels < 240).any(-1).mean()
    assert 0.05 < not_white < 0.95


def test_report_dom_after_scripts_ran(chromium, report):
    model, path = report
    T, cfg = len(TEXT), model.config
    dom = _parse(chromium.dump_dom(path.as_uri()))
    tokens = dom.within("tokens", "span", "token")
    assert [int(t["data-pos"]) for t in tokens] == list(range(T))
    cells = dom.within("attention-heatmap", "rect", "cell")
    assert len(cells) == T * T
    assert len(dom.within("layer-select", "option")) == cfg.n_layers
    assert len(dom.within("head-select", "option")) == cfg.n_heads + 1  # + "mean of heads"
    assert len(dom.within("topk", "tr")) == T + 1  # header + one row per position
    assert len(dom.within("logit-lens", "tr")) == cfg.n_layers + 2  # header + embed + each block
    assert len(dom.within("logit-lens", "td", "lens-cell")) == (cfg.n_layers + 1) * T


@pytest.mark.parametrize("layer,head", [(0, 0), (2, 3), (1, "mean")])
def test_heatmap_draws_the_selected_layer_and_head(chromium, report, layer, head):
    model, path = report
    dom = _parse(chromium.dump_dom(f"{path.as_uri()}#layer={layer}&head={head}"))
    (svg,) = [attrs for tag, attrs, _ in dom.elements if attrs.get("id") == "attention-heatmap"]
    assert (svg["data-layer"], svg["data-head"]) == (str(layer), str(head))
    T = len(TEXT)
    drawn = np.zeros((T, T))
    for cell in dom.within("attention-heatmap", "rect", "cell"):
        drawn[int(cell["data-query"]), int(cell["data-key"])] = float(cell["data-weight"])
    _, cache = run_with_cache(model, TEXT)
    pattern = cache["pattern", layer][0]  # (nh, T, T)
    expected = pattern.mean(0) if head == "mean" else pattern[head]
    np.testing.assert_allclose(drawn, expected.numpy(), atol=2e-3)
