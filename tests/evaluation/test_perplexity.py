"""``lucidlm.perplexity`` / ``lucidlm perplexity`` against transformers' documented sliding-window
recipe ("Perplexity of fixed-length models"), run on the Hugging Face twin of the model: windows
of max_length every stride, the tokens an earlier window scored labelled -100, ``outputs.loss``
weighted by the tokens each window really scores.

Two points where the recipe as printed and lucidlm differ, and the oracle below follows lucidlm:
the recipe weights each window by (labelled tokens - 1), one too few wherever windows overlap
(there the first labelled token is not the window's first, so the label shift drops none); and
a last window that scores nothing (stride == max_length, a text one token past a multiple of
it) gives it a NaN loss, where lucidlm runs no such window.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

import lucidlm
from lucidlm.errors import InputError
from random_weights import randomize_

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB, CONTEXT = 258, 128  # 256 bytes, <|endoftext|> 256, <s> 257


def hf_recipe(hf, input_ids: torch.Tensor, max_length: int, stride: int) -> tuple[float, int, list[float]]:
    """(ppl, tokens scored, each window's nll sum) by transformers' recipe on ``input_ids`` (1, N)."""
    seq_len = input_ids.size(1)
    nll_sum, n_tokens, windows, prev_end_loc = 0.0, 0, [], 0
    for begin_loc in range(0, seq_len, stride):
        end_loc = min(begin_loc + max_length, seq_len)
        trg_len = end_loc - prev_end_loc
        window = input_ids[:, begin_loc:end_loc]
        target_ids = window.clone()
        target_ids[:, :-trg_len] = -100
        scored = int((target_ids[:, 1:] != -100).sum())  # what the loss averages over, after HF's shift
        if scored:
            with torch.no_grad():
                loss = hf(window, labels=target_ids).loss.item()
            nll_sum += loss * scored
            n_tokens += scored
            windows.append(loss * scored)
        prev_end_loc = end_loc
        if end_loc == seq_len:
            break
    return math.exp(nll_sum / n_tokens), n_tokens, windows


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(transformers LlamaForCausalLM, lucidlm's model) with the same random weights."""
    import transformers

    from lucidlm.language_model import LanguageModel
    from lucidlm.weights.hf import load_hf

    path = tmp_path_factory.mktemp("tiny_llama")
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=CONTEXT,
                                      tie_word_embeddings=False, bos_token_id=None, eos_token_id=None)
    hf = randomize_(transformers.LlamaForCausalLM(config), seed=3, norm_spread=0.1)
    hf.save_pretrained(path)
    return hf, load_hf(path, model_cls=LanguageModel)


def random_ids(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("n,max_length,stride", [
    (203, 64, 64),    # no overlap; 203 is no multiple of the stride
    (193, 64, 64),    # one token past a multiple: the recipe's last window would score nothing
    (203, 64, 32),    # half-window overlap
    (203, 50, 17),    # an overlap that divides nothing
    (90, 64, 5),      # many windows, the last one short
    (100, 128, 64),   # a text shorter than one window
])
def test_equals_the_transformers_recipe(pair, n, max_length, stride):
    hf, ours = pair
    ids = random_ids(n)
    want_ppl, want_tokens, want_windows = hf_recipe(hf, ids, max_length, stride)
    got = lucidlm.perplexity(ours, ids, max_length=max_length, stride=stride)
    assert got.tokens == want_tokens == sum(w.tokens for w in got.windows)
    assert got.text_tokens == n and (got.max_length, got.stride) == (max_length, stride)
    assert got.ppl == pytest.approx(want_ppl, rel=1e-4)
    assert math.exp(got.nll) == pytest.approx(got.ppl, rel=1e-12)
    assert [w.nll for w in got.windows] == pytest.approx(want_windows, rel=1e-4)
    if stride < max_length:  # overlapping windows score every token after the first exactly once
        assert got.tokens == n - 1


def test_batch_size_gives_the_same_figure(pair):
    _, ours = pair
    ids = random_ids(203, seed=1)
    one = lucidlm.perplexity(ours, ids, max_length=64, stride=24, batch_size=1)
    for batch_size in (3, 64):  # 3 leaves a partial batch; 64 holds every window, the short last one apart
        many = lucidlm.perplexity(ours, ids, max_length=64, stride=24, batch_size=batch_size)
        assert many.ppl == pytest.approx(one.ppl, rel=1e-5)
        assert [w.nll for w in many.windows] == pytest.approx([w.nll for w in one.windows], rel=1e-5)
        assert [(w.begin, w.end, w.tokens) for w in many.windows] == [(w.begin, w.end, w.tokens) for w in one.windows]


@pytest.fixture(scope="module")
def bos_tokenizer_json(tmp_path_factory):
    """A byte-level tokenizer.json whose post-processor puts <s> first, as Llama's and Gemma's do."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    byte_chars = {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}  # GPT-2's
    vocab = {byte_chars[b]: b for b in range(256)} | {"<|endoftext|>": 256, "<s>": 257}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(["<|endoftext|>", "<s>"])
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 257)])
    path = tmp_path_factory.mktemp("bos_tokenizer") / "tokenizer.json"
    backend.save(str(path))
    return path


TEXT = "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n" * 3


def test_text_is_tokenized_once_with_the_tokenizers_bos(pair, bos_tokenizer_json):
    """BOS as the recipe's ``tokenizer(text)`` puts it: once, first, where the tokenizer adds one."""
    import transformers

    from lucidlm.tokenizers import HFTokenizer

    hf, ours = pair
    ours.tokenizer = HFTokenizer.from_file(bos_tokenizer_json)
    hf_ids = transformers.PreTrainedTokenizerFast(tokenizer_file=str(bos_tokenizer_json))(
        TEXT, return_tensors="pt").input_ids  # (1, N)
    assert hf_ids[0, 0] == 257 and (hf_ids == 257).sum() == 1  # the oracle's own BOS: once, first
    want_ppl, want_tokens, _ = hf_recipe(hf, hf_ids, 64, 32)
    got = ours.perplexity(TEXT, max_length=64, stride=32)
    assert got.text_tokens == hf_ids.shape[1] and got.tokens == want_tokens
    assert got.ppl == pytest.approx(want_ppl, rel=1e-4)


def test_errors_are_one_clear_line(pair):
    _, ours = pair
    with pytest.raises(InputError, match="at least 2"):
        lucidlm.perplexity(ours, [5])
    with pytest.raises(InputError, match="stride=65 is invalid.*longer than the window"):
        lucidlm.perplexity(ours, random_ids(100), max_length=64, stride=65)
    with pytest.raises(InputError, match=f"max_length=129 is invalid.*context of {CONTEXT}"):
        lucidlm.perplexity(ours, random_ids(100), max_length=129)
    with pytest.raises(InputError, match="no option 'strde'.*did you mean 'stride'"):
        lucidlm.perplexity(ours, random_ids(100), strde=4)


# -- the command -----------------------------------------------------------------------------

def run_command(capsys, *args: str) -> tuple[int, str, str]:
    from lucidlm import cli

    code = cli.main(["perplexity", "-q", *args])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.slow
def test_smollm2_equals_transformers_and_the_command_equals_python(smollm2, hf_smollm2, shared_dir, tmp_path, capsys):
    """The embedded model in float32 against transformers' LlamaForCausalLM reading the same GGUF,
    on a short slice of tinyshakespeare; and ``lucidlm perplexity --json`` gives the same figure."""
    hf, hf_tokenizer = hf_smollm2
    text = (shared_dir / "data" / "tinyshakespeare.txt").read_text(encoding="utf-8")[-700:]
    hf_ids = hf_tokenizer(text, return_tensors="pt").input_ids  # (1, N), BOS as transformers' tokenizer adds it
    assert hf_ids[0].tolist() == smollm2.tokenizer.encode(text)
    want_ppl, want_tokens, _ = hf_recipe(hf, hf_ids, 96, 64)
    got = smollm2.perplexity(text, max_length=96, stride=64, batch_size=2)
    assert got.tokens == want_tokens and 3 < got.ppl < 200
    assert got.ppl == pytest.approx(want_ppl, rel=1e-4)

    data = tmp_path / "slice.txt"
    data.write_text(text, encoding="utf-8")
    code, out, err = run_command(capsys, "--data", str(data), "--dtype", "float32", "--context", "96",
                                 "--stride", "64", "--json")
    assert code == 0, err
    line = json.loads(out)
    assert line["ppl"] == pytest.approx(got.ppl, rel=1e-6) and line["tokens"] == got.tokens
    assert len(line["windows"]) == len(got.windows)


@pytest.mark.parametrize("content,flags,message", [
    (b"", (), r"evaluation corpus is empty \(\S+text.txt holds no text\)"),
    (b"a", ("--model", "gpt2", "--random-init"), "1 token long; perplexity scores each token after the first"),
    (b"caf\xe9", (), "is not UTF-8 text: byte 0xe9 at offset 3"),
    (b"hello", ("--context", "64", "--stride", "65"), "--stride 65 is longer than --context 64"),
    (b"hello", ("--context", "1"), "--context=1 is invalid"),
    (None, (), "evaluation data .* does not exist"),
])
def test_command_errors_are_one_line(tmp_path, capsys, content, flags, message):
    import re

    data = tmp_path / "text.txt"
    if content is not None:
        data.write_bytes(content)
    code, out, err = run_command(capsys, "--data", str(data), *flags)
    assert code == 1 and out == ""
    assert err.count("\n") == 1 and err.startswith("lucidlm perplexity: error: "), err
    assert re.search(message, err), err


def test_a_training_model_is_scored_without_dropout_and_left_training():
    """Dropout would make the figure random: scored in eval mode (the oracle: torch's own
    cross-entropy on the eval-mode logits), and the model handed back in the mode it was in."""
    from lucidlm import ModelConfig
    from lucidlm.language_model import LanguageModel

    torch.manual_seed(0)
    model = LanguageModel(ModelConfig(vocab_size=100, d_model=32, n_layers=2, n_heads=2, max_seq_len=64, dropout=0.5))
    ids = torch.randint(0, 100, (1, 40), generator=torch.Generator().manual_seed(2))
    model.train()
    got = lucidlm.perplexity(model, ids, max_length=64)
    assert model.training and all(m.training for m in model.modules())
    model.eval()
    with torch.no_grad():
        want = torch.nn.functional.cross_entropy(model(ids)[0, :-1], ids[0, 1:]).exp().item()
    assert got.ppl == pytest.approx(want, rel=1e-5)


def test_ids_as_numpy_arrays_and_nested_lists_read_as_one_sequence(pair):
    """(1, T) ids as numpy (a tokenizer's return_tensors="np") or a nested list are one sequence of
    T tokens, as the (1, T) tensor the recipe passes; they were read as one token ('1 token long')."""
    hf, ours = pair
    ids = random_ids(90, seed=4)
    want_ppl, want_tokens, _ = hf_recipe(hf, ids, 64, 32)
    for value in (ids.numpy(), ids.tolist(), ids[0].numpy().astype("int32"), iter(ids[0].tolist())):
        got = lucidlm.perplexity(ours, value, max_length=64, stride=32)
        assert got.tokens == want_tokens and got.ppl == pytest.approx(want_ppl, rel=1e-4), type(value)
    with pytest.raises(InputError, match="2 rows of ids: give one sequence"):
        lucidlm.perplexity(ours, torch.cat([ids, ids]).numpy())


def test_a_diverged_model_scores_infinity_as_torch_does():
    """A mean nll past float64's exp range (~709 nats) is perplexity inf, as the recipe's
    torch.exp gives it; math.exp raised OverflowError (the CLI's internal-error line)."""
    from lucidlm import ModelConfig
    from lucidlm.language_model import LanguageModel

    torch.manual_seed(0)
    model = LanguageModel(ModelConfig(vocab_size=100, d_model=32, n_layers=2, n_heads=2, max_seq_len=64)).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "embed" in name:
                parameter.mul_(3000)  # logits in the thousands: a diverged run's
    ids = torch.randint(0, 100, (1, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = torch.nn.functional.cross_entropy(model(ids)[0, :-1], ids[0, 1:]).double()
    assert 709 < want < math.inf and want.exp() == math.inf  # the oracle: finite nll, infinite perplexity
    got = lucidlm.perplexity(model, ids, max_length=64)
    assert got.nll == pytest.approx(want.item(), rel=1e-5)
    assert got.ppl == want.exp().item() and got.windows[0].ppl == math.inf


def saved_char_model(tmp_path, text: str, diverged: bool = False):
    """A character model saved to tmp_path/run and ``text`` in tmp_path/text.txt: (the text's
    path, its ids (1, T), torch's cross-entropy of the model's logits on them, the oracle).
    ``diverged``: logits in the thousands, a diverged run's."""
    from lucidlm import ModelConfig
    from lucidlm.language_model import LanguageModel
    from lucidlm.tokenizers import CharTokenizer
    from lucidlm.weights.checkpoint import save_model

    tokenizer = CharTokenizer.train(text)
    torch.manual_seed(0)
    model = LanguageModel(ModelConfig(vocab_size=tokenizer.vocab_size, d_model=32, n_layers=2, n_heads=2,
                                      max_seq_len=128), tokenizer).eval()
    if diverged:
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if "embed" in name:
                    parameter.mul_(10000)
    save_model(model, tmp_path / "run")
    data = tmp_path / "text.txt"
    data.write_text(text, encoding="utf-8")
    ids = torch.tensor([tokenizer.encode(text)])
    with torch.no_grad():
        return data, ids, torch.nn.functional.cross_entropy(model(ids)[0, :-1].double(), ids[0, 1:])


def test_the_command_prints_a_diverged_models_infinity_as_json_null(tmp_path, capsys):
    """--json's ppl inf was written as Infinity, which is no JSON (json.loads with strict
    constants and jq refuse it); null, as generate --json writes a -inf log-prob. The oracle
    for the figure: torch's cross-entropy of the saved model's logits."""
    data, ids, want = saved_char_model(tmp_path, "to be or not to be, that is the question\n" * 2, diverged=True)
    assert want.isfinite() and want.exp().isinf()  # the oracle: a finite nll, a perplexity beyond float64

    def no_constants(name):
        raise ValueError(f"{name} is not JSON")

    code, out, err = run_command(capsys, "--data", str(data), "--model", str(tmp_path / "run"), "--json")
    assert code == 0, err
    line = json.loads(out, parse_constant=no_constants)
    assert line["ppl"] is None and line["nll"] == pytest.approx(want.item(), rel=1e-4)
    assert line["tokens"] == ids.shape[1] - 1


def test_the_commands_line_gives_torchs_figure_and_counts_one_window(tmp_path, capsys):
    """The plain (not --json) line: the perplexity of torch's cross-entropy on the saved model's
    logits, the tokens scored, and one window as "1 window" (it said "1 windows")."""
    data, ids, want = saved_char_model(tmp_path, "to be or not to be, that is the question\n")
    code, out, err = run_command(capsys, "--data", str(data), "--model", str(tmp_path / "run"))
    assert code == 0, err
    assert out.startswith(f"perplexity {want.exp().item():.4f} (nll {want.item():.4f} nats/token) over "
                          f"{ids.shape[1] - 1} tokens of {data}: 1 window of 128, stride 64, "), out


@pytest.mark.skipif(not hasattr(__import__("os"), "mkfifo"), reason="named pipes are POSIX's")
def test_a_pipe_as_data_is_named_as_one_not_as_missing(tmp_path, capsys):
    """--data <(cmd) is /dev/fd/63, a pipe that exists (os.path.exists, the oracle); the error said
    it 'does not exist'. Nothing is read from it (which would block with no writer)."""
    import os

    fifo = tmp_path / "fifo.txt"
    os.mkfifo(fifo)
    assert os.path.exists(fifo)
    code, out, err = run_command(capsys, "--data", str(fifo), "--model", "gpt2", "--random-init")
    assert code == 1 and out == "" and err.count("\n") == 1, err
    assert "is not a regular file or folder (a pipe or a device" in err and "does not exist" not in err
