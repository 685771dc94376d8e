"""The notebooks in notebooks/ run top to bottom on CPU, and what they print is checked here."""

from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"


def _run(name: str):
    notebook = nbformat.read(NOTEBOOKS / name, as_version=4)
    nbclient.NotebookClient(notebook, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()
    text = "".join(out.get("text", "") for cell in notebook.cells if cell.cell_type == "code"
                   for out in cell.get("outputs", []))
    html = "".join(out.get("data", {}).get("text/html", "") for cell in notebook.cells if cell.cell_type == "code"
                   for out in cell.get("outputs", []))
    return text, html


def _value(text: str, label: str) -> float:
    line = next(line for line in text.splitlines() if line.startswith(label))
    return float(line.split("=")[1])


def test_notebook_002_gpt2_run_with_cache():
    text, html = _run("002_gpt2_run_with_cache.ipynb")
    assert "<|endoftext|>" in text
    assert _value(text, "max |logits - recomputed|") < 1e-4
    assert _value(text, "max |pattern - recomputed|") < 1e-5
    assert "blocks.0.attn.hook_pattern       (1, 4, 6, 6)" in text
    assert "predicted:" in text and "embed" in text and "1_mlp_out" in text
    assert 'class="lucidlm-attention"' in html  # the attention view displayed inline


def test_notebook_000_numpy_forward():
    text, _ = _run("000_numpy_forward.ipynb")
    assert "logits (32, 1000)" in text
    assert _value(text, "max relative difference") < 1e-9
    assert _value(text, "max |hook_embed - numpy embeddings|") < 1e-9


def test_notebook_001_llama_pieces(smollm2):  # the fixture: the embedded SmolLM2 must be installed
    text, _ = _run("001_llama_from_scratch.ipynb")
    assert "30 layers; 9 query heads, 3 key/value heads" in text
    assert "next token: ' Paris'" in text
    assert _value(text, "max |rms - hook_scale|") < 1e-5
    assert _value(text, "max |pattern - recomputed|") < 1e-5
    assert _value(text, "max |swiglu - hook_post|") < 1e-5
    assert "generated: ' Paris" in text


def test_notebook_003_components_streaming(smollm2):  # the fixture: the embedded SmolLM2 must be installed
    text, _ = _run("003_components_streaming.ipynb")
    for label in ("max |RMSNorm - formula|", "max |RoPE interleaved - complex form|", "max |RoPE half - complex form|",
                  "max |Attention - sdpa|", "max |sdpa - softmax formula|", "max |MLP - swiglu formula|"):
        assert _value(text, label) < 1e-5, label
    assert "norms kept: True" in text
    entropies = [float(line.split("entropy ")[1].split()[0]) for line in text.splitlines() if line.startswith("T=")]
    assert len(entropies) == 3 and entropies[0] < entropies[1] < entropies[2]  # hotter is flatter
    assert "stream joined == generate: True" in text
    assert len(next(line for line in text.splitlines() if line.startswith("streamed: "))) > len("streamed: ''")


def test_notebook_004_attention_training_lora(monkeypatch):
    shakespeare = NOTEBOOKS.parent.parent / "shared" / "data" / "tinyshakespeare.txt"
    monkeypatch.setenv("LUCIDLM_SHAKESPEARE", str(shakespeare))  # the kernel inherits it
    text, html = _run("004_attention_training_lora.ipynb")
    assert _value(text, "max |sinusoidal - formula|") < 1e-6
    assert "PE(3).PE(7) == PE(20).PE(24): True" in text
    uniform, first, last = (_value(text, label) for label in ("uniform guess", "first loss", "last loss"))
    assert abs(first - uniform) < 0.3  # a fresh model guesses about uniformly
    assert last < first - 0.5 and _value(text, "val loss") < uniform - 0.5  # and learned something
    assert "sample characters all seen in training: True" in text
    assert _value(text, "max |pattern - recomputed|") < 1e-5
    assert 'class="lucidlm-attention"' in html and 'class="lucidlm-report"' in html  # both displayed inline
    # rank 4 on q_proj and v_proj (64 -> 64) of 2 layers: r * (in + out) each
    assert "trainable 2,048 of" in text
    assert _value(text, "max |LoRA layer - W x + (alpha/r) B A x|") < 1e-5
    assert _value(text, "LoRA last loss") < _value(text, "LoRA first loss")
    assert _value(text, "max |merged - unmerged logits|") < 1e-5
