"""Edges of sampling and generation, each against a reference: top-p on a large vocabulary
(transformers' TopPLogitsWarper and the exact float64 nucleus), beam search with a stop string
(transformers' beam search with stop_strings), options float32 cannot hold, the text of an
output that leaves a prompt's incomplete UTF-8 character incomplete (Python's own UTF-8
decoder), and the end-of-generation tokens of GGUF files (llama.cpp's rule)."""

from __future__ import annotations

import random
import re

import pytest
import torch
from generation_toys import (ScriptedModel, byte_tokenizer, hf_byte_tokenizer, one_torch_thread,  # noqa: F401
                             sharpened_llama_pair)  # (one_torch_thread: autouse fixture)
from test_no_host_sync import reading_back_forbidden

from lucidlm.errors import GenerationError
from lucidlm.generation import check_options, generate, generate_batch, stream
from lucidlm.generation.sampling import SamplingSettings, process_logits, sample_next, top_p_filter
from lucidlm.generation.streaming import TextAssembler
from lucidlm.tokenizers.gguf_tokenizer import end_of_generation_ids

transformers = pytest.importorskip("transformers")
from transformers.generation.logits_process import (RepetitionPenaltyLogitsProcessor,  # noqa: E402
                                                    TopPLogitsWarper)

EOS = 256


# -- top-p on a large vocabulary -----------------------------------------------------------------

def exact_nucleus_size(row: torch.Tensor, p: float) -> int:
    """How many tokens the smallest set of most likely tokens with mass >= p holds, in float64."""
    probs = torch.softmax(row.double(), -1).sort(descending=True).values
    mass_before = torch.cat([torch.zeros(1, dtype=torch.double), probs.cumsum(0)[:-1]])
    return int((mass_before < p).sum())


@pytest.mark.parametrize("vocab, p", [(262_144, 0.999), (262_144, 0.95), (150_000, 0.999), (50_000, 0.9)])
def test_top_p_keeps_transformers_set_on_large_vocabularies(vocab, p):
    """Summed from the top in float32, the kept set fell hundreds of tokens short of p (V=262k,
    p=0.999: 148602 tokens holding 0.998934 of the mass, against 150586)."""
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(2, vocab, generator=gen) * 2 / 0.7  # (2, V): Gemma 3's vocabulary at temperature 0.7
    ours = torch.isinf(top_p_filter(logits, p))
    theirs = torch.isinf(TopPLogitsWarper(p)(None, logits.clone()))
    assert torch.equal(ours, theirs)
    for row, dropped in zip(logits, ours):
        assert int((~dropped).sum()) == exact_nucleus_size(row, p)
        assert float(torch.softmax(row.double(), -1)[~dropped].sum()) >= p


def test_top_p_reads_nothing_back_to_python():
    """The filter runs every decode step: it stays on the device (no .item(), no .tolist())."""
    logits = torch.randn(3, 4096, generator=torch.Generator().manual_seed(0))
    settings = SamplingSettings(temperature=0.7, top_p=0.95)
    with reading_back_forbidden():
        filtered = top_p_filter(logits, 0.95)
        sample_next(logits, settings, generator=torch.Generator().manual_seed(0))
    assert torch.equal(torch.isinf(filtered), torch.isinf(TopPLogitsWarper(0.95)(None, logits.clone())))


# -- beam search with a stop string ---------------------------------------------------------------

@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return sharpened_llama_pair(tmp_path_factory.mktemp("tiny_llama"), EOS)


def test_beam_search_with_a_stop_string_cuts_token_ids_like_greedy(pair):
    hf, ours = pair
    prompt = [5, 6, 7]

    def hf_beams(**kwargs):
        return hf.generate(torch.tensor([prompt]), do_sample=False, num_beams=2, max_new_tokens=8, eos_token_id=EOS,
                           pad_token_id=EOS, length_penalty=0.0, **kwargs)[0, len(prompt):].tolist()

    beams = hf_beams()
    # a one-byte stop string that ends a beam: HF's stop_strings pick that beam (length_penalty 0
    # favours it over the longer ones); the search without stop strings goes another way
    stop = "&"
    expected_ids = hf_beams(stop_strings=[stop], tokenizer=hf_byte_tokenizer())
    assert expected_ids[-1] == ord(stop) and beams[:len(expected_ids)] != expected_ids
    expected_text = bytes(expected_ids[:-1]).decode("utf-8", errors="replace")  # the text before it

    result = generate(ours, prompt, max_new_tokens=8, num_beams=2, length_penalty=0.0, stop=stop)
    assert (result.token_ids, result.text, result.finish_reason) == (expected_ids, expected_text, "stop")
    pieces = stream(ours, prompt, max_new_tokens=8, num_beams=2, length_penalty=0.0, stop=stop)
    assert "".join(pieces) == expected_text
    assert (pieces.result.token_ids, pieces.result.finish_reason) == (expected_ids, "stop")
    # without the stop string, the full beam (the reference's ids) comes back
    assert generate(ours, prompt, max_new_tokens=8, num_beams=2, length_penalty=0.0).token_ids == beams


# -- options that cannot apply, and values float32 cannot hold -----------------------------------

def test_length_penalty_without_beams_is_refused_everywhere(pair):
    _, ours = pair
    fragment = "length_penalty=5 scores beam search's hypotheses; add num_beams=N (N > 1)"
    calls = [lambda: generate(ours, [5, 6, 7], max_new_tokens=2, length_penalty=5.0),
             lambda: generate(ours, [[5, 6, 7], [1, 2]], max_new_tokens=2, length_penalty=5.0),
             lambda: list(stream(ours, [5, 6, 7], max_new_tokens=2, length_penalty=5.0)),
             lambda: check_options(length_penalty=5.0)]
    for call in calls:
        with pytest.raises(GenerationError, match=re.escape(fragment)):
            call()
    check_options(length_penalty=5.0, num_beams=2)  # with beams it is what it is for
    with pytest.raises(GenerationError, match="unexpected keyword argument 'length_penalty'|length_penalty"):
        generate_batch(ours, [[5, 6, 7]], length_penalty=5.0)


@pytest.mark.parametrize("options, fragment", [
    (dict(temperature=1e39), "temperature=1e+39 is invalid: it must be at most 3.4e38"),
    (dict(repetition_penalty=1e-39), "repetition_penalty=1e-39 is invalid: it must be between 1e-30 and 1e30"),
    (dict(repetition_penalty=1e39), "repetition_penalty=1e+39 is invalid: it must be between 1e-30 and 1e30"),
    (dict(length_penalty=1e3, num_beams=2), "length_penalty=1000.0 is invalid: expected a finite number in"),
])
def test_values_float32_cannot_hold_are_refused_by_name(pair, options, fragment):
    """They used to pass the check and crash in torch.multinomial ("probability tensor contains
    either inf, nan or element < 0") or in the beam score (OverflowError)."""
    _, ours = pair
    with pytest.raises(GenerationError, match=re.escape(fragment)):
        check_options(**options)
    with pytest.raises(GenerationError, match=re.escape(fragment)):
        generate(ours, [5, 6, 7], max_new_tokens=4, min_new_tokens=0 if "num_beams" in options else 2, seed=0,
                 **options)


def test_options_that_ban_every_token_are_refused_before_generating(pair):
    """Every logit -inf used to give token 0 when greedy (banned, yet chosen; transformers does the
    same) and a torch error mid-generation when sampling ("probability tensor contains either inf,
    nan or element < 0"). The four ways to ban count together; one token left is allowed, and it is
    the one transformers' generate picks with that token alone unsuppressed."""
    hf, ours = pair
    vocab = ours.config.vocab_size
    third = vocab // 3
    everything = dict(suppress_tokens=list(range(third)), bad_words_ids=[[i] for i in range(third, 2 * third)],
                      logit_bias={i: float("-inf") for i in range(2 * third, vocab - 1)},
                      sequence_bias=[[[vocab - 1], float("-inf")]])
    fragment = f"the options ban every one of the model's {vocab} tokens"
    calls = [lambda: generate(ours, [5, 6, 7], max_new_tokens=2, temperature=0, **everything),
             lambda: generate(ours, [5, 6, 7], max_new_tokens=2, temperature=0.8, seed=0, **everything),
             lambda: list(stream(ours, [5, 6, 7], max_new_tokens=2, **everything)),
             lambda: generate_batch(ours, [[5, 6, 7], [1, 2]], max_new_tokens=2, **everything)]
    for call in calls:
        with pytest.raises(GenerationError, match=re.escape(fragment)):
            call()
    # the end token alone left, while min_new_tokens holds it back: nothing is possible either
    only_eos = [i for i in range(vocab) if i != EOS]
    with pytest.raises(GenerationError, match=re.escape(fragment + " (with the end tokens")):
        generate(ours, [5, 6, 7], max_new_tokens=4, min_new_tokens=1, suppress_tokens=only_eos)
    assert generate(ours, [5, 6, 7], max_new_tokens=4, suppress_tokens=only_eos).finish_reason == "eos"

    kept = 42  # one token left: every step takes it, as in transformers
    others = [i for i in range(vocab) if i != kept]
    expected = hf.generate(torch.tensor([[5, 6, 7]]), do_sample=False, max_new_tokens=4, suppress_tokens=others,
                           eos_token_id=EOS, pad_token_id=EOS)[0, 3:].tolist()
    assert expected == [kept] * 4
    assert generate(ours, [5, 6, 7], max_new_tokens=4, temperature=0.8, seed=1,
                    suppress_tokens=others).token_ids == expected


def test_the_extreme_values_still_allowed_compute_what_transformers_does():
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(0)) * 4
    logits[:, 7] = float("-inf")  # a banned token (min_new_tokens' EOS ban does this)
    seen = torch.tensor([[1, 2, 3], [4, 5, 6]])
    for penalty in (1e-30, 1e30):
        ours = process_logits(logits, SamplingSettings(repetition_penalty=penalty), seen)
        theirs = RepetitionPenaltyLogitsProcessor(penalty)(seen, logits.clone())
        assert torch.equal(ours, theirs) and not ours.isnan().any()
    hot = process_logits(logits, SamplingSettings(temperature=3.4e38))
    assert torch.equal(hot, logits / torch.tensor(3.4e38, dtype=torch.float32)) and not hot.isnan().any()
    draws = sample_next(logits, SamplingSettings(temperature=3.4e38), generator=torch.Generator().manual_seed(0))
    assert not (draws == 7).any()


# -- an output that does not complete the prompt's last character ------------------------------

def expected_text(prompt: list[int], output: list[int]) -> str:
    """README's rule with Python's UTF-8 decoder: decode(prompt + output) minus decode(prompt); a
    character the output completes (decode(prompt) is then no prefix) belongs to the output."""
    before = bytes(prompt).decode("utf-8", errors="replace")
    full = bytes(prompt + output).decode("utf-8", errors="replace")
    return full[len(before):] if full.startswith(before) else full[len(before) - 1:]


def assembled(prompt: list[int], output: list[int]) -> str:
    assembler = TextAssembler(byte_tokenizer(), None, [EOS], prompt)
    return "".join(assembler.add(t) for t in output) + assembler.finish()


@pytest.mark.parametrize("prompt, output", [
    ([72, 0xF0], [65, 66]),  # a 4-byte lead, then ASCII: 'AB', not '\ufffdAB'
    ([72, 0xF0, 0x9F], [0x98, 65]),  # the output continues the character, then breaks it
    ([72, 0xED, 0xBD], [65]),  # Python shows ED BD as two U+FFFD: both are the prompt's
    ([72, 0xE2], []),  # nothing generated
    ([72, 0xE2], [EOS]),  # only EOS
    ([72, 0xF0, 0x9F], [0x98, 0x80, 65]),  # the output completes the emoji: it is the output's
])
def test_the_prompts_replacement_character_is_not_the_outputs(prompt, output):
    assert assembled(prompt, output) == expected_text(prompt, [t for t in output if t != EOS])


def test_text_follows_the_rule_for_random_bytes_at_the_boundary():
    rng = random.Random(0)
    pool = [65, 66] + list(range(0x80, 0x100))
    for _ in range(3000):
        prompt = [rng.choice(pool) for _ in range(rng.randint(1, 4))]
        output = [rng.choice(pool) for _ in range(rng.randint(0, 5))]
        whole = bytes(prompt[-3:] + output[:3])
        if b"\xef\xbf\xbd" in whole:  # U+FFFD itself split across the boundary: both readings hold
            continue
        assert assembled(prompt, output) == expected_text(prompt, output), (bytes(prompt), bytes(output))


# -- GGUF end-of-generation tokens, as llama.cpp reads them ----------------------------------

def test_smollm2_stops_on_llama_cpps_end_tokens(smollm2_default):
    """llama.cpp's load log for this file lists its EOG tokens as 0 '<|endoftext|>', 2 '<|im_end|>'
    and 4 '<reponame>' (the fill-in-the-middle repo token, by its text): the file declares eos 2
    only."""
    tokenizer = smollm2_default.tokenizer
    assert tokenizer.eos_ids[0] == 2  # the file's eos first
    assert sorted(tokenizer.eos_ids) == [0, 2, 4]
    assert [tokenizer.decode([i]) for i in (0, 4)] == ["<|endoftext|>", "<reponame>"]
    # generation ends at <|endoftext|>, not only at <|im_end|>
    scripted = ScriptedModel(tokenizer, [28, 29, 0, 30, 31], prompt_len=3)
    result = generate(scripted, [28, 29, 30], temperature=0, max_new_tokens=5)
    assert (result.token_ids, result.finish_reason) == ([28, 29, 0], "eos")


def test_gemma3_stops_on_end_of_turn():
    """Gemma 3's GGUF declares eos 1 '<eos>' and no eot; llama.cpp ends on 106 '<end_of_turn>'
    and 212 '</s>' too, by their text, as its chat turns end with <end_of_turn>."""
    import lucidlm

    tokenizer = lucidlm.load("gemma3-270m").tokenizer
    assert tokenizer.eos_ids == [1, 106, 212]
    assert [tokenizer.decode([i]) for i in tokenizer.eos_ids] == ["<eos>", "<end_of_turn>", "</s>"]


def test_llama_cpps_exceptions_and_fill_in_the_middle_tokens():
    none = dict(fim_pad=None, fim_rep=None, fim_sep=None)
    # gpt-oss's harmony vocabulary: <|end|> closes a message before a tool call, so it is no end
    harmony = ["a", "<|start|>", "<|end|>", "<|return|>", "<|call|>", "<|endoftext|>"]
    assert end_of_generation_ids(harmony, [3], none) == [3, 4, 5]
    assert end_of_generation_ids(harmony[:4], [3], none) == [3, 2]  # no <|call|>: <|end|> ends
    # Gemma 4: </s> is an HTML tag there
    assert end_of_generation_ids(["<eos>", "</s>", "<|tool_response>"], [0], none) == [0, 2]
    # Qwen's fill-in-the-middle tokens, by text, unless the file names its own
    qwen = ["<|endoftext|>", "<|im_end|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<PAD>"]
    assert end_of_generation_ids(qwen, [1], none) == [1, 0, 2, 3, 4]
    assert end_of_generation_ids(qwen, [1], dict(none, fim_pad=5)) == [1, 0, 3, 4, 5]
    # type does not matter, only the text; a plain word is never an end
    assert end_of_generation_ids(["hello", "<|eot_id|>", "<end_of_turn>", "turn"], [], none) == [1, 2]


# ----------------------------------------------------------------------------- one cache per model

def test_a_paused_stream_refuses_to_go_on_after_another_generation(pair):
    """The model has one KV cache: a stream paused while generate() ran on the same model used to
    go on decoding from the other prompt's keys (wrong tokens, no error)."""
    model = pair[1]
    options = dict(max_new_tokens=12, temperature=0, stop_on_eos=False)
    alone = generate(model, "hello", **options).token_ids
    paused = iter(stream(model, "hello", **options))
    next(paused)
    other = generate(model, "world!", **options)
    with pytest.raises(GenerationError, match="another generation ran on this model"):
        list(paused)
    # the generation that took the cache over is untouched, and the model works afterwards
    assert other.token_ids == generate(model, "world!", **options).token_ids
    assert generate(model, "hello", **options).token_ids == alone


def test_closing_a_stale_stream_leaves_the_live_one_its_cache(pair):
    model = pair[1]
    options = dict(max_new_tokens=10, temperature=0, stop_on_eos=False)
    alone = generate(model, "abc", **options).text
    stale = iter(stream(model, "xyz", **options))
    next(stale)
    pieces = iter(stream(model, "abc", **options))
    text = next(pieces)
    stale.close()  # used to clear the model's cache under the live stream
    assert text + "".join(pieces) == alone


def test_an_unfinished_stream_at_exit_prints_nothing():
    import subprocess
    import sys

    code = ("import torch\n"
            "from lucidlm import LanguageModel, preset\n"
            "from lucidlm.tokenizers import BPETokenizer\n"
            "tok = BPETokenizer([], {'<|endoftext|>': 256}, eos_token='<|endoftext|>')\n"
            "m = LanguageModel(preset('llama', n_layers=1, d_model=32, n_heads=2, n_kv_heads=1, vocab_size=257,\n"
            "                         max_seq_len=64, multiple_of=32), tok)\n"
            "s = m.stream('hi', max_new_tokens=8, temperature=0)\n"
            "for piece in s:\n    break\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "Exception ignored" not in done.stderr and "Traceback" not in done.stderr, done.stderr
