"""Meta's Llama 3 format (params.json + consolidated.*.pth + tiktoken tokenizer.model), on a
tiny random checkpoint written here the way Meta's release lays it out, as one file and as
model-parallel shards.

Oracles: transformers' own ``convert_llama_weights_to_hf.write_model`` (the script Meta's
checkpoints are converted with; scripts/install.sh --test fetches it from the last wheel
that shipped it) for the weights, and tiktoken for the tokenizer, with the script's own list
of Llama 3 special tokens.
"""

from __future__ import annotations

import base64
import importlib.util
import json
import pickle
from pathlib import Path

import pytest
import torch
from torch.testing import assert_close

import lucidlm
from lucidlm.errors import CheckpointError, ConfigError, ShapeMismatchError
from lucidlm.tokenizers import load_tokenizer
from lucidlm.tokenizers.tiktoken_bpe import LLAMA3_SPLIT_PATTERN

ORACLE = Path(__file__).resolve().parents[1] / "oracles" / "convert_llama_weights_to_hf.py"
PARAMS = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=0, multiple_of=32, ffn_dim_multiplier=1.3,
              norm_eps=1e-5, rope_theta=500000.0)
CORPUS = ("The quick brown fox jumps over the lazy dog. Llamas don't like 123456 numbers; naïve café! "
          "   spaces\n\nnew lines\r\n日本語 👋🏽 ") * 4


@pytest.fixture(scope="module")
def converter():
    if not ORACLE.is_file():
        pytest.skip(f"{ORACLE} is missing: run scripts/install.sh --test")
    spec = importlib.util.spec_from_file_location("convert_llama_weights_to_hf", ORACLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tiny_ranks() -> dict[bytes, int]:
    """A small tiktoken vocabulary: the 256 bytes (in a shuffled order, as real files have
    them), then merges learned on CORPUS by a plain BPE loop written here."""
    order = list(range(256))
    order = order[128:] + order[:128]
    ranks = {bytes([b]): i for i, b in enumerate(order)}
    import regex

    chunks = [[bytes([b]) for b in c.encode()] for c in regex.findall(LLAMA3_SPLIT_PATTERN, CORPUS)]
    while len(ranks) < 400:
        counts: dict[tuple[bytes, bytes], int] = {}
        for c in chunks:
            for pair in zip(c, c[1:]):
                counts[pair] = counts.get(pair, 0) + 1
        if not counts:
            break
        a, b = max(counts, key=lambda p: (counts[p], p))
        ranks[a + b] = len(ranks)
        for c in chunks:
            i = 0
            while i < len(c) - 1:
                if c[i] == a and c[i + 1] == b:
                    c[i:i + 2] = [a + b]
                i += 1
    return ranks


def write_meta_checkpoint(directory: Path, seed: int = 0, params: dict | None = None, extra=None) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    ranks = tiny_ranks()
    (directory / "tokenizer.model").write_text(
        "".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in ranks.items()))
    params = {**PARAMS, "vocab_size": len(ranks) + 256, **(params or {})}
    (directory / "params.json").write_text(json.dumps(params))
    dim, head_dim = params["dim"], params["dim"] // params["n_heads"]
    hidden = 32 * ((int(1.3 * int(8 * dim / 3)) + 31) // 32)
    g = torch.Generator().manual_seed(seed)

    def w(*shape):  # Meta's checkpoints are bf16
        return (torch.randn(*shape, generator=g) * 0.2).to(torch.bfloat16)

    state = {"tok_embeddings.weight": w(params["vocab_size"], dim), "norm.weight": 1 + w(dim),
             "output.weight": w(params["vocab_size"], dim)}
    for i in range(params["n_layers"]):
        state |= {
            f"layers.{i}.attention.wq.weight": w(params["n_heads"] * head_dim, dim),
            f"layers.{i}.attention.wk.weight": w(params["n_kv_heads"] * head_dim, dim),
            f"layers.{i}.attention.wv.weight": w(params["n_kv_heads"] * head_dim, dim),
            f"layers.{i}.attention.wo.weight": w(dim, params["n_heads"] * head_dim),
            f"layers.{i}.feed_forward.w1.weight": w(hidden, dim),
            f"layers.{i}.feed_forward.w2.weight": w(dim, hidden),
            f"layers.{i}.feed_forward.w3.weight": w(hidden, dim),
            f"layers.{i}.attention_norm.weight": 1 + w(dim),
            f"layers.{i}.ffn_norm.weight": 1 + w(dim),
        }
    torch.save(extra if extra is not None else state, directory / "consolidated.00.pth")
    return directory


def test_logits_match_transformers_conversion_script(tmp_path, converter):
    meta = write_meta_checkpoint(tmp_path / "meta")
    vocab = json.loads((meta / "params.json").read_text())["vocab_size"]
    converter.write_model(str(tmp_path / "hf"), str(meta), llama_version="3", vocab_size=vocab, num_shards=1)
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    ours = lucidlm.load(meta)
    assert ours.config.d_mlp == hf.config.intermediate_size and ours.config.rope_theta == 500000.0
    ids = torch.randint(0, vocab, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(ids).logits
        assert expected.std() > 0.3
        assert_close(ours(ids), expected, atol=1e-4, rtol=1e-4)


def test_tokenizer_matches_tiktoken_with_llama3_specials(tmp_path, converter):
    import tiktoken

    meta = write_meta_checkpoint(tmp_path / "meta")
    ranks = tiny_ranks()
    specials = converter.DEFAULT_LLAMA_SPECIAL_TOKENS["3"]
    reference = tiktoken.Encoding(name="llama3_tiny", pat_str=LLAMA3_SPLIT_PATTERN, mergeable_ranks=ranks,
                                  special_tokens={t: len(ranks) + i for i, t in enumerate(specials)})
    tok = lucidlm.load(meta).tokenizer
    assert tok.vocab_size == reference.n_vocab
    texts = [CORPUS, "Hello world!!! 1234567 don't", "<|begin_of_text|><|start_header_id|>user<|end_header_id|>"
             "\n\nhi<|eot_id|>", "rare ǅ 𝔘𝔫𝔦 \t\t tabs", ""]
    for text in texts:
        assert tok.encode(text) == reference.encode(text, allowed_special="all")
        assert tok.encode(text, allowed_special=False) == reference.encode(text, disallowed_special=())
        assert tok.decode(tok.encode(text)) == text
    assert (tok.bos_id, tok.eos_id) == (reference.encode_single_token("<|begin_of_text|>"),
                                        reference.encode_single_token("<|end_of_text|>"))
    assert reference.encode_single_token("<|eot_id|>") in tok.eos_ids
    tok.save(tmp_path / "tok.json")
    assert load_tokenizer(tmp_path / "tok.json").encode(CORPUS) == tok.encode(CORPUS)


class Payload:
    def __reduce__(self):  # would run print() if unpickled without weights_only
        return (print, ("code ran",))


@pytest.mark.parametrize("payload,message", [
    ({"layers.0.attention.wq.weight": Payload()}, "other than tensors"),
    ({"model": {"tok_embeddings.weight": torch.zeros(2)}, "step": 3}, "non-tensor values"),
    ([torch.zeros(2)], "holds list"),
])
def test_a_pth_holding_anything_but_tensors_is_refused(tmp_path, payload, message, capsys):
    meta = write_meta_checkpoint(tmp_path / "meta", extra=payload)
    with pytest.raises(CheckpointError, match=message):
        lucidlm.load(meta)
    assert "code ran" not in capsys.readouterr().out


def test_params_json_with_wrong_sizes_names_the_tensor(tmp_path):
    meta = write_meta_checkpoint(tmp_path / "meta")
    params = json.loads((meta / "params.json").read_text())
    (meta / "params.json").write_text(json.dumps(dict(params, dim=96)))
    with pytest.raises(ShapeMismatchError, match=r"params.json\): tensor 'embed.weight' has shape \(\d+, 64\), expected \(\d+, 96\)"):
        lucidlm.load(meta)
    (meta / "params.json").write_text(json.dumps(dict(params, n_layers="two")))
    with pytest.raises(ConfigError, match=r"field 'n_layers' is 'two'; expected an integer"):
        lucidlm.load(meta)


def test_the_pickle_payload_really_would_run_code(tmp_path, capsys):
    """The refusal above is not vacuous: the same file unpickled naively runs the code."""
    path = write_meta_checkpoint(tmp_path / "meta", extra={"x": Payload()}) / "consolidated.00.pth"
    torch.load(path, weights_only=False)
    assert "code ran" in capsys.readouterr().out
    with pytest.raises(pickle.UnpicklingError):
        torch.load(path, weights_only=True)


# Model-parallel shards (70B ships as consolidated.00.pth ... .07.pth). The split here is written
# independently of lucidlm from fairscale's layout, as transformers' converter reverses it:
# column-parallel (wq/wk/wv, w1/w3, output) cut along dim 0, row-parallel (wo, w2) along dim 1,
# norms copied whole; the embedding is cut along the vocabulary in Llama 3, the width in Llama 1/2.
def split_dim_of(name: str, embed_dim: int) -> int | None:
    if name == "tok_embeddings.weight":
        return embed_dim
    if name.endswith(("wo.weight", "w2.weight")):
        return 1
    return None if name.endswith("norm.weight") else 0


def write_shards(one: Path, out: Path, n: int, embed_dim: int = 0) -> Path:
    out.mkdir()
    for f in ("params.json", "tokenizer.model"):
        (out / f).write_bytes((one / f).read_bytes())
    state = torch.load(one / "consolidated.00.pth", weights_only=True)
    for rank in range(n):
        shard = {k: v.clone() if split_dim_of(k, embed_dim) is None else v.chunk(n, split_dim_of(k, embed_dim))[rank]
                 .clone() for k, v in state.items()}
        torch.save(shard, out / f"consolidated.{rank:02d}.pth")
    return out


@pytest.mark.parametrize("n_shards,n_kv_heads,embed_dim", [(2, 2, 0), (4, 4, 0), (2, 2, 1)])
def test_sharded_checkpoint_loads_like_the_single_file(tmp_path, n_shards, n_kv_heads, embed_dim):
    one = write_meta_checkpoint(tmp_path / "one", seed=3, params=dict(n_kv_heads=n_kv_heads, vocab_size=608))
    many = write_shards(one, tmp_path / "many", n_shards, embed_dim)
    ids = torch.randint(0, 600, (2, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = lucidlm.load(one)(ids)
        assert expected.std() > 0.3
        assert torch.equal(lucidlm.load(many)(ids), expected)


def test_sharded_logits_match_transformers_conversion_script(tmp_path, converter):
    meta = write_shards(write_meta_checkpoint(tmp_path / "one", seed=4, params=dict(vocab_size=608)), tmp_path / "meta", 2)
    vocab = json.loads((meta / "params.json").read_text())["vocab_size"]
    converter.write_model(str(tmp_path / "hf"), str(meta), llama_version="3", vocab_size=vocab, num_shards=2)
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    ids = torch.randint(0, vocab, (2, 32), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected = hf(ids).logits
        assert expected.std() > 0.3
        assert_close(lucidlm.load(meta)(ids), expected, atol=1e-4, rtol=1e-4)


def test_inconsistent_shards_are_refused_naming_shard_and_tensor(tmp_path):
    one = write_meta_checkpoint(tmp_path / "one", params=dict(n_kv_heads=4, vocab_size=608))
    many = write_shards(one, tmp_path / "many", 4)
    (many / "consolidated.02.pth").rename(tmp_path / "away.pth")
    with pytest.raises(CheckpointError, match=r"holds 3 shards but lacks consolidated\.02\.pth"):
        lucidlm.load(many)
    (many / "consolidated.03.pth").unlink()  # now 00, 01: two quarters look like a 2-shard split gone wrong
    with pytest.raises(CheckpointError, match=r"consolidated\.00\.pth: tensor 'tok_embeddings\.weight' has "
                                              r"shape \(152, 64\), expected \(304, 64\) \(1/2 of \(608, 64\)"):
        lucidlm.load(many)
    two = write_shards(one, tmp_path / "two", 2)
    state = torch.load(two / "consolidated.01.pth", weights_only=True)
    torch.save(dict(state, **{"layers.1.ffn_norm.weight": state["layers.1.ffn_norm.weight"] + 1}),
               two / "consolidated.01.pth")
    with pytest.raises(CheckpointError, match=r"consolidated\.01\.pth: replicated tensor 'layers\.1\.ffn_norm"):
        lucidlm.load(two)
    del state["layers.1.ffn_norm.weight"]
    torch.save(state, two / "consolidated.01.pth")
    with pytest.raises(CheckpointError, match=r"consolidated\.01\.pth: its tensor names differ.*ffn_norm"):
        lucidlm.load(two)
    (two / "consolidated.01.pth").rename(two / "consolidated.02.pth")
    with pytest.raises(CheckpointError, match=r"lacks consolidated\.01\.pth"):
        lucidlm.load(two)
    three = write_shards(one, tmp_path / "three", 2)
    (three / "consolidated.02.pth").write_bytes((three / "consolidated.01.pth").read_bytes())
    with pytest.raises(CheckpointError, match=r"3 shards cannot split 4 query / 4 KV heads"):
        lucidlm.load(three)
