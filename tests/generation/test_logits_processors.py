"""The logits processors users of transformers, llama.cpp and the OpenAI API expect beside the
samplers: no-repeat n-grams, suppressed and banned tokens, sequence and logit biases, presence
and frequency penalties. Each against transformers' own processor on many random rows, in the
order its GenerationMixin builds them, and end to end against its generate (greedy, sampled,
beams) on the tiny Llama twin; then the options through the command line, chat's /set and a
generation_config.json."""

from __future__ import annotations

import io
import json
import re

import numpy as np
import pytest
import torch
from generation_toys import (assert_compiled_samples_like_eager, model_dir, one_torch_thread,  # noqa: F401 (fixtures)
                             only_generate_and_chat, reader, sharpened_llama_pair, toy_model)
from test_no_host_sync import reading_back_forbidden

from lucidlm import cli
from lucidlm.commands.chat import chat_loop
from lucidlm.errors import GenerationError
from lucidlm.generation import check_options, generate, generate_batch, stream
from lucidlm.generation.sampling import (SamplingSettings, apply_processors, no_repeat_ngram_filter, process_logits,
                                         sample_next)

transformers = pytest.importorskip("transformers")
from transformers.generation.logits_process import (NoBadWordsLogitsProcessor,  # noqa: E402
                                                    NoRepeatNGramLogitsProcessor, SequenceBiasLogitsProcessor,
                                                    SuppressTokensLogitsProcessor)

EOS = 256
MAX_NEW = 14
# prompts that repeat themselves, so that the n-gram ban has something to find from the start
PROMPTS = [[5, 6, 7, 5, 6], [100, 20, 30, 40, 50], [1], [250, 3, 3, 3, 9, 80, 81, 3, 3]]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return sharpened_llama_pair(tmp_path_factory.mktemp("tiny_llama"), EOS)


def random_case(seed: int, rows: int, seen: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (rows, vocab) with a banned token and seen ids (rows, seen) drawn from a few ids,
    so that n-grams repeat."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=gen)
    logits[:, 0] = float("-inf")
    ids = torch.randint(0, min(vocab, 2 + seed % 5), (rows, seen), generator=gen)
    return logits, ids


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("n", [1, 2, 3, 4, 7])
def test_no_repeat_ngram_equals_transformers(seed, n):
    rows, seen, vocab = 1 + seed % 4, [1, 3, 6, 20, 64, 9][seed % 6], [5, 8, 50, 1000][seed % 4]
    logits, ids = random_case(seed, rows, seen, vocab)
    expected = NoRepeatNGramLogitsProcessor(n)(ids, logits.clone())
    assert torch.equal(no_repeat_ngram_filter(logits, ids, n), expected)
    assert torch.equal(process_logits(logits, SamplingSettings(no_repeat_ngram_size=n), ids), expected)


def test_no_repeat_ngram_skips_a_rows_left_padding():
    """A left-padded row (its padding repeats its first token) bans what transformers bans for
    the row alone: the padding's made-up n-grams ban nothing."""
    logits, _ = random_case(0, 2, 1, 20)
    short, long = [4, 5, 4], [7, 4, 4, 9, 4, 5, 4]
    seen = torch.tensor([[4] * (len(long) - len(short)) + short, long])  # (2, 7), as sample_rows pads
    padding = torch.tensor([[len(long) - len(short)], [0]])
    got = no_repeat_ngram_filter(logits, seen, 2, padding)
    for row, ids in enumerate((short, long)):
        expected = NoRepeatNGramLogitsProcessor(2)(torch.tensor([ids]), logits[row:row + 1].clone())
        assert torch.equal(got[row:row + 1], expected), row
    assert torch.isinf(no_repeat_ngram_filter(logits, seen, 2)[0, 4])  # without it, (4, 4) of the padding bans 4


def random_sequences(seed: int, count: int, vocab: int, ids: int) -> list[list[int]]:
    """``count`` distinct token id sequences of 1 to 4 ids, most drawn from the first ``ids`` ids
    (those random_case's rows are made of, so that their prefixes match)."""
    gen = torch.Generator().manual_seed(seed)
    found: list[list[int]] = []
    while len(found) < count:
        length = int(torch.randint(1, 5, (1,), generator=gen))
        high = vocab if len(found) % 3 == 2 else ids
        sequence = torch.randint(0, high, (length,), generator=gen).tolist()
        if sequence not in found:
            found.append(sequence)
    return found


@pytest.mark.parametrize("seed", range(16))
def test_suppress_tokens_and_bad_words_equal_transformers(seed):
    rows, seen, vocab = 1 + seed % 4, [1, 3, 6, 20, 64][seed % 5], [5, 8, 50, 1000][seed % 4]
    logits, ids = random_case(seed, rows, seen, vocab)
    few = min(vocab, 2 + seed % 5)
    suppressed = sorted(set(torch.randint(0, vocab, (1 + seed % 4,), generator=torch.Generator().manual_seed(seed))
                            .tolist()))
    expected = SuppressTokensLogitsProcessor(suppressed)(ids, logits.clone())
    assert torch.equal(process_logits(logits, SamplingSettings(suppress_tokens=suppressed), ids), expected)
    bad = random_sequences(seed, 1 + seed % 6, vocab, few)
    expected = NoBadWordsLogitsProcessor(bad)(ids, logits.clone())
    assert torch.equal(process_logits(logits, SamplingSettings(bad_words_ids=bad), ids), expected)


def random_biases(seed: int, sequences: list[list[int]]) -> list[list]:
    """transformers' sequence_bias for ``sequences``: [[ids, bias], ...], some biases -inf."""
    gen = torch.Generator().manual_seed(seed)
    biases = (torch.randn(len(sequences), generator=gen) * 4).tolist()
    return [[ids, float("-inf") if i % 4 == 3 else bias] for i, (ids, bias) in enumerate(zip(sequences, biases))]


@pytest.mark.parametrize("seed", range(16))
def test_sequence_and_logit_bias_equal_transformers(seed):
    """sequence_bias is transformers' SequenceBiasLogitsProcessor; logit_bias {id: bias} is the
    same processor with one-token sequences, and both together add up."""
    rows, seen, vocab = 1 + seed % 4, [1, 3, 6, 20, 64][seed % 5], [5, 8, 50, 1000][seed % 4]
    logits, ids = random_case(seed, rows, seen, vocab)
    sequence_bias = random_biases(seed, random_sequences(seed, 1 + seed % 7, vocab, min(vocab, 2 + seed % 5)))
    expected = SequenceBiasLogitsProcessor(sequence_bias)(ids, logits.clone())
    assert torch.equal(process_logits(logits, SamplingSettings(temperature=0, sequence_bias=sequence_bias), ids),
                       expected)
    as_dict = {tuple(sequence): bias for sequence, bias in sequence_bias}  # transformers' older form
    assert torch.equal(process_logits(logits, SamplingSettings(temperature=0, sequence_bias=as_dict), ids), expected)
    tokens = sorted({int(t) for t in torch.randint(0, vocab, (4,), generator=torch.Generator().manual_seed(seed))})
    logit_bias = {t: b for t, (_, b) in zip(tokens, random_biases(seed + 1, [[t] for t in tokens]))}
    expected = SequenceBiasLogitsProcessor([[[t], b] for t, b in logit_bias.items()])(ids, logits.clone())
    assert torch.equal(process_logits(logits, SamplingSettings(temperature=0, logit_bias=logit_bias), ids), expected)
    json_keys = {str(t): b for t, b in logit_bias.items()}  # OpenAI's JSON writes the ids as strings
    assert torch.equal(process_logits(logits, SamplingSettings(temperature=0, logit_bias=json_keys), ids), expected)
    both = SamplingSettings(temperature=0, sequence_bias=sequence_bias, logit_bias=logit_bias)
    expected = SequenceBiasLogitsProcessor([[[t], b] for t, b in logit_bias.items()])(
        ids, SequenceBiasLogitsProcessor(sequence_bias)(ids, logits.clone()))
    assert torch.allclose(process_logits(logits, both, ids), expected, rtol=0, atol=1e-5)


def test_settings_rebuilt_from_their_own_values_are_equal():
    """dataclasses.replace builds the settings again from the tuples they keep."""
    import dataclasses

    settings = SamplingSettings(suppress_tokens=[3], bad_words_ids=[[4, 5]], sequence_bias={(6, 7): -1.0},
                                logit_bias={"8": 2.0})
    assert dataclasses.replace(settings) == settings and hash(dataclasses.replace(settings)) == hash(settings)


def openai_penalties(logits: np.ndarray, generated: np.ndarray, presence: float, frequency: float) -> np.ndarray:
    """OpenAI's documented formula, in NumPy: mu[j] - c[j] * alpha_frequency - float(c[j] > 0) *
    alpha_presence, c[j] how often token j was sampled before (the generated tokens)."""
    out = logits.astype(np.float64)
    for row, ids in enumerate(generated):
        counts = np.bincount(ids, minlength=logits.shape[-1])
        out[row] = out[row] - counts * frequency - (counts > 0).astype(np.float64) * presence
    return out


class OpenAIPenalties(transformers.LogitsProcessor):
    """The formula as a processor transformers' generate runs (after its own), for the
    generated tokens: those after the first ``prompt_len`` of input_ids."""

    def __init__(self, prompt_len: int, presence: float, frequency: float) -> None:
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids, scores):
        out = openai_penalties(scores.numpy(), input_ids[:, self.prompt_len:].numpy(), self.presence, self.frequency)
        return torch.from_numpy(out).to(scores.dtype)


@pytest.mark.parametrize("seed", range(12))
def test_presence_and_frequency_penalties_equal_openais_formula(seed):
    rows, seen, vocab = 1 + seed % 4, [1, 3, 6, 20, 64, 9][seed % 6], [5, 8, 50, 1000][seed % 4]
    logits, ids = random_case(seed, rows, seen, vocab)
    prompt_len = seed % 4 if seen > 3 else 0
    presence, frequency = [(0.5, 0.0), (0.0, 0.7), (1.3, -0.4), (-2.0, 2.0)][seed % 4]
    expected = openai_penalties(logits.numpy(), ids[:, prompt_len:].numpy(), presence, frequency)
    settings = SamplingSettings(temperature=0, presence_penalty=presence, frequency_penalty=frequency)
    got = process_logits(logits, settings, ids, prompt_len=prompt_len)
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-6, atol=1e-5)
    assert torch.equal(torch.isinf(got), torch.isinf(logits))


def test_bad_words_skip_a_rows_left_padding():
    """A left-padded row's padding (its first token repeated) never completes a banned prefix."""
    logits, _ = random_case(0, 2, 1, 20)
    short, long = [4, 5], [7, 4, 4, 9, 4, 5]
    seen = torch.tensor([[4] * (len(long) - len(short)) + short, long])
    padding = torch.tensor([[len(long) - len(short)], [0]])
    bad = [[4, 4, 5, 6], [4, 5, 7], [9]]
    got = apply_processors(logits, SamplingSettings(bad_words_ids=bad), seen, padding)
    for row, ids in enumerate((short, long)):
        expected = NoBadWordsLogitsProcessor(bad)(torch.tensor([ids]), logits[row:row + 1].clone())
        assert torch.equal(got[row:row + 1], expected), row
    # without padding, the padding's 4 4 5 bans 6
    assert torch.isinf(apply_processors(logits, SamplingSettings(bad_words_ids=bad), seen)[0, 6])


@pytest.mark.parametrize("seed", range(6))
def test_the_order_is_generation_mixins_processor_list(seed):
    """Every processor at once, and the warpers after them, on random rows and seen ids: the list
    transformers' GenerationMixin builds for the same options, so each sees the others' output."""
    from transformers import GenerationConfig

    logits, ids = random_case(seed, 4, 30, 300)
    bad = random_sequences(seed, 5, 300, 2 + seed % 5)
    options = dict(repetition_penalty=1.4, no_repeat_ngram_size=1 + seed % 3, bad_words_ids=bad,
                   suppress_tokens=[3, 7, int(ids[0, -1])],
                   sequence_bias=random_biases(seed, random_sequences(seed + 1, 6, 300, 2 + seed % 5)))
    warpers = [dict(), dict(temperature=0.7, top_k=50, top_p=0.9, min_p=0.05)][seed % 2]
    config = GenerationConfig(do_sample=bool(warpers), **options, **warpers)
    config._eos_token_tensor = None  # generate() sets it before building the list
    processors = hf_tiny_llama()._get_logits_processor(config, input_ids_seq_length=ids.shape[1], device="cpu")
    expected = processors(ids, logits.clone())
    got = process_logits(logits, SamplingSettings(temperature=warpers.get("temperature", 0), **options,
                                                  **{k: v for k, v in warpers.items() if k != "temperature"}), ids)
    assert torch.equal(got, expected)


def hf_tiny_llama():
    config = transformers.LlamaConfig(vocab_size=300, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, bos_token_id=None,
                                      eos_token_id=None, pad_token_id=0)
    return transformers.LlamaForCausalLM(config).eval()


def hf_generate(hf, prompt, **options):
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW, eos_token_id=EOS, pad_token_id=EOS,
                      **options)[0, len(prompt):].tolist()
    return out[:out.index(EOS) + 1] if EOS in out else out


@pytest.mark.parametrize("options", [dict(no_repeat_ngram_size=1), dict(no_repeat_ngram_size=2),
                                     dict(no_repeat_ngram_size=3, repetition_penalty=1.3),
                                     dict(suppress_tokens=[144, 54, 21, 93, 81]),
                                     # sequences the prompts' greedy and beam outputs hold
                                     dict(bad_words_ids=[[144, 172, 136], [90, 90], [2, 185], [6, 76, 227], [81, 184],
                                                         [105, 245, 6]]),
                                     dict(bad_words_ids=[[54], [172, 7]], suppress_tokens=[93],
                                          no_repeat_ngram_size=2),
                                     dict(sequence_bias=[[[144, 172], -30.0], [[90], -2.5], [[2, 185], 1.5],
                                                         [[54], -20.0], [[81, 184], -40.0], [[6], 3.0]])])
@pytest.mark.parametrize("num_beams", [1, 3])
def test_greedy_and_beams_equal_transformers_generate(pair, options, num_beams):
    hf, ours = pair
    changed = 0
    for prompt in PROMPTS:
        expected = hf_generate(hf, prompt, do_sample=False, num_beams=num_beams, **options)
        assert generate(ours, prompt, temperature=0, num_beams=num_beams, max_new_tokens=MAX_NEW,
                        **options).token_ids == expected, prompt
        changed += expected != hf_generate(hf, prompt, do_sample=False, num_beams=num_beams)
    assert changed  # the option made a difference


@pytest.mark.parametrize("penalties", [dict(presence_penalty=4.0), dict(frequency_penalty=2.5),
                                       dict(presence_penalty=-1.0, frequency_penalty=3.0, repetition_penalty=1.2)])
@pytest.mark.parametrize("num_beams", [1, 3])
def test_presence_and_frequency_penalties_in_transformers_generate(pair, penalties, num_beams):
    """No transformers option: its generate with OpenAI's formula as a processor of its own."""
    hf, ours = pair
    changed = 0
    presence, frequency = penalties.get("presence_penalty", 0.0), penalties.get("frequency_penalty", 0.0)
    for prompt in PROMPTS:
        processors = transformers.LogitsProcessorList([OpenAIPenalties(len(prompt), presence, frequency)])
        expected = hf_generate(hf, prompt, do_sample=False, num_beams=num_beams, logits_processor=processors,
                               repetition_penalty=penalties.get("repetition_penalty"))
        assert generate(ours, prompt, temperature=0, num_beams=num_beams, max_new_tokens=MAX_NEW,
                        **penalties).token_ids == expected, prompt
        changed += expected != hf_generate(hf, prompt, do_sample=False, num_beams=num_beams,
                                           repetition_penalty=penalties.get("repetition_penalty"))
    assert changed


@pytest.mark.parametrize("num_beams", [1, 3])
def test_logprobs_are_transformers_scores_after_the_processors(pair, num_beams):
    """Greedy and beam log-probs with processors on: transformers' transition scores (greedy:
    normalized from its processed scores; beams: the processed log-probs they summed)."""
    hf, ours = pair
    options = dict(no_repeat_ngram_size=2, sequence_bias=[[[144, 172], -3.0], [[54], 2.0]], suppress_tokens=[21],
                   bad_words_ids=[[90, 90]])
    for prompt in PROMPTS:
        result = generate(ours, prompt, temperature=0, num_beams=num_beams, max_new_tokens=MAX_NEW, logprobs=True,
                          **options)
        out = hf.generate(torch.tensor([prompt]), do_sample=False, num_beams=num_beams, max_new_tokens=MAX_NEW,
                          eos_token_id=EOS, pad_token_id=EOS, return_dict_in_generate=True, output_scores=True,
                          **options)
        if num_beams == 1:
            transition = hf.compute_transition_scores(out.sequences, out.scores, normalize_logits=True)[0]
        else:
            transition = hf.compute_transition_scores(out.sequences, out.scores, out.beam_indices)[0]
        assert result.token_ids == out.sequences[0, len(prompt):len(prompt) + len(result.token_ids)].tolist()
        torch.testing.assert_close(torch.tensor(result.logprobs), transition[:len(result.token_ids)], rtol=0,
                                   atol=1e-4)


def test_a_left_padded_batch_equals_transformers(pair):
    """A greedy batch with no_repeat_ngram_size: transformers' batch (left-padded, with its mask)."""
    hf, ours = pair
    L = max(map(len, PROMPTS))
    ids = torch.tensor([[EOS] * (L - len(p)) + p for p in PROMPTS])
    mask = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in PROMPTS])
    options = dict(no_repeat_ngram_size=2, bad_words_ids=[[2, 185], [76, 227]], sequence_bias=[[[9, 80], 5.0]])
    penalties = transformers.LogitsProcessorList([OpenAIPenalties(L, 0.5, 1.5)])
    out = hf.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=MAX_NEW, eos_token_id=EOS,
                      pad_token_id=EOS, logits_processor=penalties, **options)[:, L:].tolist()
    expected = [row[:row.index(EOS) + 1] if EOS in row else row for row in out]
    got = generate_batch(ours, PROMPTS, temperature=0, max_new_tokens=MAX_NEW, presence_penalty=0.5,
                         frequency_penalty=1.5, **options)
    assert [r.token_ids for r in got] == expected


@pytest.mark.parametrize("options", [dict(temperature=0.7, top_k=40, no_repeat_ngram_size=2, repetition_penalty=1.2),
                                     dict(temperature=1.5, top_p=0.9, no_repeat_ngram_size=1),
                                     dict(temperature=0.9, min_p=0.02, sequence_bias=[[[5, 6], 2.0]],
                                          bad_words_ids=[[7, 5]], suppress_tokens=[81])])
def test_sampling_applies_them_in_transformers_order(pair, options):
    """transformers' sampled generate gives each step's raw logits and the scores it sampled
    from: process_logits turns the one into the other, exactly."""
    hf, _ = pair
    prompt = torch.tensor([PROMPTS[0], PROMPTS[3][:5]])
    torch.manual_seed(1)
    out = hf.generate(prompt, do_sample=True, max_new_tokens=8, return_dict_in_generate=True, output_scores=True,
                      output_logits=True, eos_token_id=None, pad_token_id=EOS,
                      **{"top_k": 0, **options})
    settings = SamplingSettings(**options)
    for step, (raw, scores) in enumerate(zip(out.logits, out.scores)):
        seen = out.sequences[:, :prompt.shape[1] + step]
        assert torch.equal(process_logits(raw.float(), settings, seen), scores), step


def test_sampling_with_them_reads_nothing_back():
    """They run at every decode step, outside the compiled step: tensor ops on the device, no
    .item() or .tolist() (a host sync on a GPU), for a left-padded batch as sample_rows gives;
    their tables are made at the first step and kept."""
    logits, seen = random_case(3, 3, 40, 4096)
    padding = torch.tensor([[5], [0], [39]])
    settings = SamplingSettings(temperature=0.8, no_repeat_ngram_size=3, suppress_tokens=[5, 9],
                                bad_words_ids=[[1, 2], [3]], sequence_bias=[[[0, 1, 2], -3.0], [[7], 2.0]],
                                logit_bias={11: 4.0}, presence_penalty=0.3, frequency_penalty=0.2)
    with reading_back_forbidden():
        for _ in range(3):
            processed = process_logits(logits, settings, seen, padding, prompt_len=30)
            sample_next(logits, settings, seen, torch.Generator().manual_seed(0), padding=padding, prompt_len=30)
    for row in range(3):
        real = seen[row:row + 1, int(padding[row]):]
        expected = SequenceBiasLogitsProcessor([[[0, 1, 2], -3.0], [[7], 2.0], [[11], 4.0]])(real, logits[row:row + 1])
        expected = torch.from_numpy(openai_penalties(expected.numpy(), seen[row:row + 1, 30:].numpy(), 0.3, 0.2)).float()
        expected = NoRepeatNGramLogitsProcessor(3)(real, expected) if real.shape[1] >= 3 else expected
        expected = NoBadWordsLogitsProcessor([[1, 2], [3]])(real, expected)
        expected = SuppressTokensLogitsProcessor([5, 9])(real, expected) / 0.8
        torch.testing.assert_close(processed[row:row + 1], expected, rtol=1e-6, atol=1e-5)


def test_a_compiled_model_uses_them_without_recompiling():
    assert_compiled_samples_like_eager(no_repeat_ngram_size=2, suppress_tokens=[3], bad_words_ids=[[5, 6]],
                                       sequence_bias=[[[7], -1.0]], logit_bias={8: 2.0}, presence_penalty=0.5,
                                       frequency_penalty=0.25)


@pytest.mark.parametrize("options, fragment", [
    (dict(no_repeat_ngram_size=-1), "no_repeat_ngram_size=-1 is invalid: use a whole number >= 0"),
    (dict(no_repeat_ngram_size=2.5), "no_repeat_ngram_size=2.5 is invalid"),
    (dict(no_repeat_ngram_size="3"), "no_repeat_ngram_size='3' is invalid"),
    (dict(suppress_tokens=[3, -1]), "suppress_tokens=[3, -1] is invalid: give a list of token ids (whole numbers"),
    (dict(suppress_tokens=5), "suppress_tokens=5 is invalid: give a list of token ids"),
    (dict(suppress_tokens="13"), "suppress_tokens='13' is invalid"),
    (dict(bad_words_ids=[3, 4]), "bad_words_ids=[3, 4] is invalid: give a list of non-empty lists of token ids"),
    (dict(bad_words_ids=[[3], []]), "bad_words_ids=[[3], []] is invalid"),
    (dict(bad_words_ids=[[3, 1.5]]), "bad_words_ids[0]=[3, 1.5] is invalid: give a list of token ids"),
    (dict(sequence_bias=[[1, 2], 3.0]), "sequence_bias=[[1, 2], 3.0] is invalid: give a list of [token ids, bias]"),
    (dict(sequence_bias=[[[], 3.0]]), "sequence_bias biases [], which is not a sequence"),
    (dict(sequence_bias=[[[4, 5], float("nan")]]), "sequence_bias[(4, 5)]=nan is invalid: a bias is a finite number"),
    (dict(sequence_bias={(4,): float("inf")}), "sequence_bias[(4,)]=inf is invalid: a bias is a finite number added "
                                                "to the logit (-100 to 100 is OpenAI's range), or -inf to ban it."),
    (dict(logit_bias={5: float("nan")}), "logit_bias[5]=nan is invalid: a bias is a finite number"),
    # past float32's largest number: torch refused to store it, mid-generation
    (dict(logit_bias={5: 1e39}), "logit_bias[5]=1e+39 is invalid: a bias must be between -1e30 and 1e30"),
    (dict(sequence_bias=[[[4, 5], -2e30]]), "sequence_bias[(4, 5)]=-2e+30 is invalid: a bias must be between"),
    (dict(logit_bias={5: "2"}), "logit_bias[5]='2' is invalid"),
    (dict(logit_bias={-3: 1.0}), "logit_bias has key -3, which is not a token id (a whole number >= 0)"),
    (dict(logit_bias={"\u00b2": 1.0}), "logit_bias has key '\u00b2', which is not a token id"),  # a digit, not a number
    (dict(logit_bias=[5, 1.0]), "logit_bias=[5, 1.0] is invalid: give a dict {token id: bias}"),
    (dict(presence_penalty=float("nan")), "presence_penalty=nan is invalid: expected a finite number"),
    (dict(frequency_penalty="1"), "frequency_penalty='1' is invalid: expected a finite number"),
    # beyond float32, 0 * inf made every logit NaN
    (dict(frequency_penalty=1e39), "frequency_penalty=1e+39 is invalid: it must be between -1e30 and 1e30"),
    (dict(presence_penalty=-2e30), "presence_penalty=-2e+30 is invalid: it must be between -1e30 and 1e30"),
])
def test_bad_values_are_refused_by_name(options, fragment):
    with pytest.raises(GenerationError, match=re.escape(fragment)):
        check_options(**options)


@pytest.mark.parametrize("options, fragment", [
    (dict(suppress_tokens=[3, 257]), "suppress_tokens names token id 257, outside this model's vocabulary 0..256"),
    (dict(bad_words_ids=[[3], [5, 900]]), "bad_words_ids names token id 900, outside this model's vocabulary 0..256"),
    (dict(logit_bias={3: 1.0, 300: -100}), "logit_bias names token id 300, outside this model's vocabulary 0..256"),
    (dict(sequence_bias=[[[400, 3], -1.0]]), "sequence_bias names token id 400, outside this model's vocabulary"),
    (dict(bad_words_ids=[[EOS]]), f"bad_words_ids bans the end token {EOS} alone, which transformers leaves possible"
                                  f" (it drops EOS from its bans); to forbid it, use suppress_tokens=[{EOS}]"),
])
def test_token_ids_outside_the_model_are_refused_before_decoding(options, fragment):
    model = toy_model(seed=0)
    for run in (lambda: generate(model, "Hi", **options), lambda: generate_batch(model, ["Hi", "Yo"], **options),
                lambda: stream(model, "Hi", **options), lambda: generate(model, "Hi", num_beams=2, **options)):
        with pytest.raises(GenerationError, match=re.escape(fragment)):
            run()
    if options.get("bad_words_ids") == [[EOS]]:  # EOS is no end token without stop_on_eos: banning it is fine
        assert EOS not in generate(model, "Hi", stop_on_eos=False, max_new_tokens=20, **options).token_ids


# -- the command line, chat and generation_config.json ------------------------------------------------

@pytest.mark.parametrize("flags, options", [
    (["--no-repeat-ngram-size", "1"], dict(no_repeat_ngram_size=1)),
    (["--suppress-tokens", "103,232"], dict(suppress_tokens=[103, 232])),
    (["--bad-words-ids", "103", "--bad-words-ids", "15,35,81"], dict(bad_words_ids=[[103], [15, 35, 81]])),
    (["--logit-bias", "103=-100", "--logit-bias", "50=7.5"], dict(logit_bias={103: -100.0, 50: 7.5})),
    (["--sequence-bias", "15,35=-inf", "--sequence-bias", "232=-3"], dict(sequence_bias=[[[15, 35], float("-inf")],
                                                                                     [[232], -3.0]])),
    (["--presence-penalty", "5", "--frequency-penalty", "0.5"], dict(presence_penalty=5.0, frequency_penalty=0.5)),
    # the toys' tokenizer writes each byte as its id
    (["--bad-words", "g", "--bad-words-ids", "15", "--bad-words", "#Q"],
     dict(bad_words_ids=[[15], list(b"g"), list(b"#Q")])),
])
def test_cli_flags_reach_the_processors(model_dir, only_generate_and_chat, capsys, flags, options):
    argv = ["generate", "Hello", "--model", model_dir, "-q", "--max-new-tokens", "12", "--temperature", "0",
            "--json", *flags]
    assert cli.main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    model = toy_model(seed=0)
    expected = generate(model, "Hello", max_new_tokens=12, temperature=0, **options)
    assert data["token_ids"] == expected.token_ids
    assert expected.token_ids != generate(model, "Hello", max_new_tokens=12, temperature=0).token_ids


@pytest.mark.parametrize("command", ["generate", "chat"])
@pytest.mark.parametrize("flags, fragment", [
    (["--no-repeat-ngram-size", "-2"], "--no-repeat-ngram-size -2 is invalid: use a whole number >= 0"),
    (["--logit-bias", "300=1"], "--logit-bias names token id 300, outside this model's vocabulary 0..256"),
    (["--frequency-penalty", "inf"], "--frequency-penalty inf is invalid: expected a finite number"),
    (["--bad-words", ""], "--bad-words '' encodes to no token; give a non-empty text."),
])
def test_cli_refuses_bad_values_in_one_line(model_dir, only_generate_and_chat, capsys, command, flags, fragment):
    argv = [command] + (["Hello"] if command == "generate" else []) + ["--model", model_dir, "-q"] + flags
    assert cli.main(argv) == 1
    captured = capsys.readouterr()
    assert captured.err.startswith(f"lucidlm {command}: error: ")
    assert captured.err.count("\n") == 1 and fragment in captured.err


@pytest.mark.parametrize("flags, fragment", [
    (["--suppress-tokens", "3,x"], "argument --suppress-tokens: '3,x' is not a list of token ids: give whole numbers "
                                   "separated by commas"),
    # negative ids, NaN and infinite biases, several ids for one logit bias: named as typed, not as the sampler's
    # option (which showed --suppress-tokens 3,-4 as "--suppress-tokens 3 --suppress-tokens -4")
    (["--suppress-tokens", "3,-4"], "argument --suppress-tokens: '3,-4' is not a list of token ids: -4 is negative"),
    (["--bad-words-ids", "3", "--bad-words-ids", "3,-4"], "argument --bad-words-ids: '3,-4' is not a list of token "
                                                          "ids: -4 is negative"),
    (["--sequence-bias", "5,-6=1"], "argument --sequence-bias: '5,-6' is not a list of token ids: -6 is negative"),
    (["--logit-bias", "3=nan"], "argument --logit-bias: '3=nan' is not IDS=BIAS with a usable bias: nan is NaN"),
    (["--logit-bias", "3=1e309"], "argument --logit-bias: '3=1e309' is not IDS=BIAS with a usable bias: 1e309 is "
                                  "infinite"),
    (["--sequence-bias", "3,4=inf"], "argument --sequence-bias: '3,4=inf' is not IDS=BIAS with a usable bias"),
    (["--logit-bias", "3,4=1"], "argument --logit-bias: '3,4=1' is not ID=BIAS: one token id per --logit-bias"),
    (["--logit-bias", "3"], "argument --logit-bias: '3' is not IDS=BIAS: give token ids separated by commas, '='"),
])
def test_a_flag_that_is_no_list_of_ids_is_refused_while_parsing(model_dir, only_generate_and_chat, capsys, flags,
                                                                fragment):
    with pytest.raises(SystemExit) as caught:
        cli.main(["generate", "Hello", "--model", model_dir, *flags])
    assert caught.value.code == 2
    assert fragment in capsys.readouterr().err


def test_chat_set_names_bad_ids_and_biases_as_typed():
    out = io.StringIO()
    chat_loop(toy_model(seed=0), dict(temperature=0, max_new_tokens=8),
              read_line=reader(["/set bad_words_ids 13;3,-4", "/set logit_bias 5=nan", "/set sequence_bias 3,4=1e309"]),
              out=out)
    assert out.getvalue().splitlines() == [
        "/set bad_words_ids 13;3,-4 is invalid: '3,-4' is not a list of token ids: -4 is negative; give whole numbers "
        ">= 0 separated by commas, e.g. 13,198.",
        "/set logit_bias 5=nan is invalid: '5=nan' is not IDS=BIAS with a usable bias: nan is NaN; give a finite "
        "number (-100 to 100 is OpenAI's range), or -inf to ban.",
        "/set sequence_bias 3,4=1e309 is invalid: '3,4=1e309' is not IDS=BIAS with a usable bias: 1e309 is infinite; "
        "give a finite number (-100 to 100 is OpenAI's range), or -inf to ban."]


def test_chat_set_takes_them():
    model = toy_model(seed=0)
    out = io.StringIO()
    chat_loop(model, dict(temperature=0, max_new_tokens=8, stop_on_eos=False),
              read_line=reader(["/set no_repeat_ngram_size 2", "/set no-repeat-ngram-size -1",
                                "/set suppress_tokens 3,9", "/set suppress_tokens 3;9",
                                "/set bad_words_ids 13;40,41", "/set bad_words_ids 13;x",
                                "/set logit_bias 72=-100,101=3", "/set sequence_bias 72,101=-5;9=1",
                                "/set presence_penalty 0.5", "/set frequency-penalty 1.5", "Hi"]), out=out)
    shown = out.getvalue().splitlines()
    assert shown[0] == "(no_repeat_ngram_size = 2)"
    assert shown[1].startswith("/set no-repeat-ngram-size -1 is invalid: use a whole number >= 0")
    assert shown[2] == "(suppress_tokens = [3, 9])"
    assert shown[3].startswith("/set suppress_tokens 3;9 is invalid: '3;9' is not a list of token ids")
    assert shown[4] == "(bad_words_ids = [[13], [40, 41]])"
    assert shown[5].startswith("/set bad_words_ids 13;x is invalid: 'x' is not a list of token ids")
    assert shown[6] == "(logit_bias = {72: -100.0, 101: 3.0})"
    assert shown[7] == "(sequence_bias = [[[72, 101], -5.0], [[9], 1.0]])"
    assert shown[8:10] == ["(presence_penalty = 0.5)", "(frequency_penalty = 1.5)"]
    from lucidlm.chat import Conversation
    convo = Conversation()
    convo.add_user("Hi")
    assert shown[-1] == "".join(convo.reply(model, temperature=0, max_new_tokens=8, stop_on_eos=False,
                                            no_repeat_ngram_size=2, suppress_tokens=[3, 9],
                                            bad_words_ids=[[13], [40, 41]], logit_bias={72: -100, 101: 3},
                                            sequence_bias=[[[72, 101], -5.0], [[9], 1.0]], presence_penalty=0.5,
                                            frequency_penalty=1.5))


def test_chat_set_refuses_ids_outside_the_model_at_once(tmp_path):
    """An id past the vocabulary is refused by /set (and /load), not kept to fail every later
    answer with an error that /reset, which it suggests, cannot clear."""
    model = toy_model(seed=0)
    saved = tmp_path / "chat.json"
    saved.write_text(json.dumps({"system": None, "messages": [], "settings": {"suppress_tokens": [3, 900]}}))
    out = io.StringIO()
    chat_loop(model, dict(temperature=0, max_new_tokens=8),
              read_line=reader(["/set logit_bias 300=1", "/set bad_words_ids 256", f"/load {saved}", "Hi"]), out=out)
    shown = out.getvalue().splitlines()
    assert shown[0].startswith("logit_bias names token id 300, outside this model's vocabulary 0..256")
    assert shown[1].startswith("bad_words_ids bans the end token 256 alone")
    assert shown[2].startswith(f"cannot load {saved}: suppress_tokens names token id 900")
    from lucidlm.chat import Conversation
    convo = Conversation()
    convo.add_user("Hi")
    assert shown[-1] == "".join(convo.reply(model, temperature=0, max_new_tokens=8))  # the settings as they were


def test_stream_and_the_model_methods_take_them():
    from lucidlm import LanguageModel

    model = toy_model(seed=0, model_cls=LanguageModel)
    options = dict(temperature=0, max_new_tokens=12, no_repeat_ngram_size=1)
    expected = generate(model, "Hello", **options)
    assert expected.token_ids != generate(model, "Hello", temperature=0, max_new_tokens=12).token_ids
    assert "".join(stream(model, "Hello", **options)) == expected.text
    assert "".join(model.stream("Hello", **options)) == expected.text
    assert model.generate("Hello", **options).token_ids == expected.token_ids


def test_generation_config_json_gives_them_as_transformers_reads_it(tmp_path):
    """transformers applies a generation_config.json's no_repeat_ngram_size when greedy too."""
    from lucidlm.generation.defaults import sampling_defaults_for

    fields = {"no_repeat_ngram_size": 3, "suppress_tokens": [5, 9], "bad_words_ids": [[4], [7, 8]],
              "sequence_bias": [[[4, 5], -2.0], [[6], 1.5]]}
    (tmp_path / "generation_config.json").write_text(json.dumps(fields))
    found, theirs = sampling_defaults_for(tmp_path), transformers.GenerationConfig.from_pretrained(tmp_path)
    assert found["temperature"] == 0  # greedy: do_sample is not set
    for name in fields:
        assert found[name] == getattr(theirs, name) or _as_lists(found[name]) == getattr(theirs, name)


def _as_lists(value):
    return [_as_lists(v) for v in value] if isinstance(value, (tuple, list)) else value


@pytest.mark.parametrize("fields, fragment", [
    ({"suppress_tokens": "5"}, "field 'suppress_tokens': suppress_tokens='5' is invalid"),
    ({"bad_words_ids": [[]]}, "field 'bad_words_ids': bad_words_ids=[[]] is invalid"),
    ({"presence_penalty": 1e39}, "presence_penalty"),
])
def test_a_bad_generation_config_field_is_named_with_the_file(tmp_path, fields, fragment):
    from lucidlm.errors import ConfigError
    from lucidlm.generation.defaults import sampling_defaults_for

    (tmp_path / "generation_config.json").write_text(json.dumps(fields))
    with pytest.raises(ConfigError, match=re.escape(fragment)) as caught:
        sampling_defaults_for(tmp_path)
    assert "generation_config.json" in str(caught.value)
