"""The HTML report: the numbers it embeds, self-containment, escaping, errors, and the CLI command."""

import argparse
import json
import re

import pytest
import torch

from lucidlm.commands import inspect as inspect_command
from lucidlm.errors import InputError, LucidLMError, TokenizerError
from lucidlm.inspect import build_report, run_with_cache, write_report
from lucidlm.inspect.report import MAX_REPORT_TOKENS

TEXT = "Hi, you!"


def _embedded_data(page):
    match = re.search(r'<script type="application/json" id="report-data">(.*?)</script>', page, re.S)
    return json.loads(match.group(1))


def test_report_embeds_the_model_outputs(tiny_model):
    page = build_report(tiny_model, TEXT, top_k=4)
    data = _embedded_data(page)
    ids = torch.tensor([tiny_model.tokenizer.encode(TEXT)])
    assert data["ids"] == ids[0].tolist()
    assert data["tokens"] == list(TEXT)
    with torch.no_grad():
        probs = torch.softmax(tiny_model(ids)[0], dim=-1)  # (T, V)
    top = probs.topk(4, dim=-1)
    assert [[p["id"] for p in row] for row in data["topk"]] == top.indices.tolist()
    embedded_probs = torch.tensor([[p["prob"] for p in row] for row in data["topk"]])
    torch.testing.assert_close(embedded_probs, top.values, atol=1e-5, rtol=0)
    assert data["topk"][0][0]["token"] == tiny_model.tokenizer.id_to_token(int(top.indices[0, 0]))

    _, cache = run_with_cache(tiny_model, ids)
    T = len(TEXT)  # rows are stored up to the diagonal: pad them back to (L, nh, T, T)
    attention = torch.tensor([[[row + [0.0] * (T - len(row)) for row in head] for head in layer]
                              for layer in data["attention"]])
    assert [len(row) for row in data["attention"][1][2]] == list(range(1, T + 1))
    assert attention.shape == (2, 4, len(TEXT), len(TEXT))
    for layer in range(2):
        torch.testing.assert_close(attention[layer], cache["pattern", layer][0], atol=5e-4, rtol=0)
    lens_final = data["lens"]["tokens"][-1]
    assert lens_final == [tiny_model.tokenizer.id_to_token(int(i)) for i in probs.argmax(-1)]
    assert data["lens"]["labels"] == ["embed", "0", "1"]


def test_report_is_self_contained_and_ascii(tiny_model):
    page = build_report(tiny_model, TEXT)
    page.encode("ascii")  # non-ASCII text travels as JSON escapes
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page)
    assert "<link" not in page and "@import" not in page
    for element_id in ("tokens", "topk", "attention-heatmap", "logit-lens", "layer-select", "head-select"):
        assert f'id="{element_id}"' in page


def test_text_cannot_break_out_of_the_page(make_model):
    model = make_model("llama")
    text = "</script><b>x</b>'"
    page = build_report(model, text)
    assert page.count("</script>") == 2  # the data block and the code, nothing injected
    assert _embedded_data(page)["text"] == text


def test_report_errors(tiny_model, tmp_path):
    with pytest.raises(InputError, match="empty"):
        build_report(tiny_model, "")
    with pytest.raises(InputError, match="top_k"):
        build_report(tiny_model, TEXT, top_k=0)
    with pytest.raises(InputError, match=f"at most {MAX_REPORT_TOKENS} tokens"):
        build_report(tiny_model, "a" * (MAX_REPORT_TOKENS + 1))
    with pytest.raises(TokenizerError, match="not in this CharTokenizer's alphabet"):
        build_report(tiny_model, "caf\u00e9")
    tiny_model.tokenizer = None
    with pytest.raises(TokenizerError, match="no tokenizer"):
        write_report(tiny_model, TEXT, tmp_path / "r.html")
    assert not (tmp_path / "r.html").exists()


def _parser():
    parser = argparse.ArgumentParser(prog="lucidlm")
    inspect_command.register(parser.add_subparsers(dest="command"))
    return parser


def test_inspect_command_writes_the_report(tiny_model, tmp_path, capsys):
    from lucidlm.weights.checkpoint import save_model

    save_model(tiny_model, tmp_path / "model")
    out = tmp_path / "out" / "report.html"
    args = _parser().parse_args(["inspect", TEXT, "--model", str(tmp_path / "model"), "--out", str(out),
                                 "--top-k", "3", "--plots", str(tmp_path / "figs")])
    assert args.handler(args) == 0
    page = out.read_text()
    data = _embedded_data(page)
    assert data["tokens"] == list(TEXT) and len(data["topk"][0]) == 3
    assert f"<title>lucidlm inspect: {tmp_path / 'model'}</title>" in page  # the model asked for, not "llama"
    assert oct(out.stat().st_mode & 0o777) != oct(0o600)  # an ordinary file, not a private staging one
    figures = sorted(p.name for p in (tmp_path / "figs").iterdir())
    assert figures == ["attention_layer0.png", "attention_layer0.svg", "attention_layer1.png",
                       "attention_layer1.svg", "logit_lens.png", "logit_lens.svg"]
    assert "wrote" in capsys.readouterr().out


def test_an_unwritable_plots_dir_stops_before_the_report(tiny_model, tmp_path):
    """--plots that cannot be made is one error before report.html is written. Under /proc root
    passes the access check, yet no directory can be made there: the report used to be written
    first, then the figures failed (a non-root user is refused by the check itself)."""
    from lucidlm.weights.checkpoint import save_model

    save_model(tiny_model, tmp_path / "model")
    out = tmp_path / "report.html"
    args = _parser().parse_args(["inspect", TEXT, "--model", str(tmp_path / "model"), "--out", str(out),
                                 "--plots", "/proc/lucidlm-figs"])
    with pytest.raises(LucidLMError, match="--plots"):
        args.handler(args)
    assert not out.exists()


def test_inspect_command_errors(tiny_model, tmp_path):
    from lucidlm.weights.checkpoint import save_model

    save_model(tiny_model, tmp_path / "model")
    for argv, message in ((["", "--model", str(tmp_path / "model")], "TEXT is empty"),
                          (["hi", "--model", str(tmp_path / "model"), "--top-k", "0"], "--top-k 0")):
        args = _parser().parse_args(["inspect", *argv, "--out", str(tmp_path / "r.html")])
        with pytest.raises(LucidLMError, match=message):
            args.handler(args)
    help_text = _parser()._subparsers._group_actions[0].choices["inspect"].format_help()
    assert "--top-k" in help_text and "logit lens" in help_text


def test_through_cli_main(tiny_model, tmp_path, capsys):
    from lucidlm.cli import main
    from lucidlm.weights.checkpoint import save_model

    save_model(tiny_model, tmp_path / "model")
    out = tmp_path / "r.html"
    assert main(["inspect", TEXT, "--model", str(tmp_path / "model"), "--out", str(out)]) == 0
    assert _embedded_data(out.read_text())["tokens"] == list(TEXT)
    capsys.readouterr()
    assert main(["inspect", "\u00e9", "-q", "--model", str(tmp_path / "model"), "--out", str(out)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("lucidlm inspect: error:") and "alphabet" in err and "\n" not in err


def test_report_displays_inline_in_its_own_frame(tiny_model):
    from html.parser import HTMLParser

    class Frames(HTMLParser):  # what a browser sees: the iframes and their decoded srcdoc pages
        def __init__(self):
            super().__init__()
            self.frames, self.other = [], []

        def handle_starttag(self, tag, attrs):
            (self.frames if tag == "iframe" else self.other).append(dict(attrs))

    page = build_report(tiny_model, TEXT)
    first, second = page._repr_html_(), page._repr_html_()
    parsed = Frames()
    parsed.feed(first + second)
    assert len(parsed.frames) == 2 and parsed.other == []  # nothing of the page leaks beside the frame
    assert parsed.frames[0]["id"] != parsed.frames[1]["id"]  # two displays never share an id
    assert parsed.frames[0]["srcdoc"] == page  # the whole page, unchanged, self-contained
    assert "allow-scripts" in parsed.frames[0]["sandbox"]


def test_report_and_view_show_token_columns_under_a_prefix(make_model):
    """With prefix tuning a pattern is (nh, T, P + T), the P prefix keys first: the report's
    rows and the attention view hold the weights on the tokens themselves (column j is
    token j), not the prefix's columns under the tokens' labels."""
    from lucidlm.inspect import attention_view
    from lucidlm.peft import add_prefix

    model = make_model("llama")
    add_prefix(model, length=3)
    ids = torch.tensor([model.tokenizer.encode(TEXT)])
    _, cache = run_with_cache(model, ids)
    T = ids.shape[1]
    assert cache["pattern", 0].shape[-2:] == (T, T + 3)
    data = _embedded_data(build_report(model, TEXT, top_k=2))
    view = attention_view(model, TEXT)
    assert view.patterns.shape == (2, 4, T, T)
    for layer in range(2):
        on_tokens = cache["pattern", layer][0][..., 3:]  # (nh, T, T)
        torch.testing.assert_close(view.patterns[layer], on_tokens)
        for head in range(4):
            for q in range(T):
                torch.testing.assert_close(torch.tensor(data["attention"][layer][head][q]),
                                           on_tokens[head, q, : q + 1], atol=5e-4, rtol=0)
