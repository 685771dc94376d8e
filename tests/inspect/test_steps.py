"""Seed 002's step-by-step view: tokens as text, and generation one token at a time."""

import io

import pytest
import torch

from lucidlm.errors import GenerationError, InputError, TokenizerError
from lucidlm.inspect import generation_steps, print_steps, to_str_tokens, to_tokens

PROMPT = "Once upon"


def _greedy_without_cache(model, ids, n):
    """Seed 002's loop: rerun the whole sequence, take the argmax of the last position."""
    ids = list(ids)
    for _ in range(n):
        logits = model(torch.tensor([ids]))
        ids.append(int(logits[0, -1].argmax()))
    return ids


def test_to_str_tokens_round_trips_the_text(tiny_model):
    pieces = to_str_tokens(tiny_model, PROMPT)
    assert "".join(pieces) == PROMPT and len(pieces) == len(PROMPT)
    ids = to_tokens(tiny_model, PROMPT)
    assert ids.shape == (1, len(PROMPT))
    assert to_str_tokens(tiny_model, ids) == pieces
    assert to_str_tokens(tiny_model, ids[0].tolist()) == pieces
    assert to_str_tokens(tiny_model, torch.cat([ids, ids])) == [pieces, pieces]
    with pytest.raises(InputError, match="tokenizes to no tokens"):
        to_tokens(tiny_model, "")


def test_greedy_steps_with_kv_cache_match_full_recomputation(tiny_model):
    with torch.no_grad():
        expected = _greedy_without_cache(tiny_model, tiny_model.tokenizer.encode(PROMPT), 8)
    steps = list(generation_steps(tiny_model, PROMPT, max_new_tokens=8, stop_at_eos=False))
    assert [s.new_id for s in steps] == expected[len(PROMPT):]
    assert steps[-1].ids == expected
    assert steps[-1].str_tokens == [tiny_model.tokenizer.id_to_token(i) for i in expected]
    with torch.no_grad():
        probs = torch.softmax(tiny_model(torch.tensor([expected[:-1]]))[0, -1], dim=-1)
    assert steps[-1].prob == pytest.approx(float(probs.max()), rel=1e-4)
    assert tiny_model.kv_caches is None  # cache handed back


def test_print_steps_prints_the_sequence_then_the_new_token(tiny_model):
    out = io.StringIO()
    final = print_steps(tiny_model, PROMPT, max_new_tokens=3, file=out, stop_at_eos=False)
    lines = out.getvalue().splitlines()
    assert len(lines) == 3
    assert lines[0] == f"{PROMPT} {final[len(PROMPT)]}"
    assert lines[2] == f"{''.join(final[:-1])} {final[-1]}"


def test_print_steps_prints_to_stdout_as_it_is_when_called(tiny_model):
    """As print() does: the default was sys.stdout bound when lucidlm.inspect was imported, so
    contextlib.redirect_stdout (and notebook or pytest capture set up later) never saw the lines."""
    import contextlib

    expected = io.StringIO()
    print_steps(tiny_model, PROMPT, max_new_tokens=3, file=expected, stop_at_eos=False)
    redirected = io.StringIO()
    with contextlib.redirect_stdout(redirected):
        print_steps(tiny_model, PROMPT, max_new_tokens=3, stop_at_eos=False)
    assert redirected.getvalue() == expected.getvalue() != ""


def test_sampling_is_reproducible_and_top_k_1_is_greedy(tiny_model):
    run = lambda **kw: [s.new_id for s in generation_steps(tiny_model, PROMPT, 6, stop_at_eos=False, **kw)]  # noqa
    assert run(temperature=1.5, seed=3) == run(temperature=1.5, seed=3)
    assert run(temperature=1.5, top_k=1, seed=3) == run()
    with pytest.raises(GenerationError, match="temperature"):
        run(temperature=-1)


def test_stops_at_eos(make_model):
    model = make_model("seed004-words")  # untied, with an unembedding bias
    eos = model.tokenizer.eos_id
    with torch.no_grad():  # make the end-of-text token the certain next token
        model.unembed.weight.zero_()
        model.unembed.bias.zero_()
        model.unembed.bias[eos] = 10.0
    steps = list(generation_steps(model, PROMPT, max_new_tokens=5))
    assert [s.new_id for s in steps] == [eos]


def test_text_needs_a_tokenizer(tiny_model):
    tiny_model.tokenizer = None
    with pytest.raises(TokenizerError, match="no tokenizer"):
        to_str_tokens(tiny_model, "hi")
    ids = [5, 6, 7]
    steps = list(generation_steps(tiny_model, ids, max_new_tokens=2, stop_at_eos=False))
    assert steps[-1].ids[:3] == ids and len(steps) == 2


def test_stops_at_every_end_token_the_model_declares(smollm2):
    """README: every end token the model declares counts (``tokenizer.eos_ids``), as in
    transformers' generate with a list of eos_token_id: SmolLM2's <|endoftext|> ends the walk
    too, not only its eos_id <|im_end|>."""
    from lucidlm import LanguageModel, preset

    tokenizer = smollm2.tokenizer
    end = next(i for i in tokenizer.eos_ids if i != tokenizer.eos_id)
    config = preset("llama", vocab_size=tokenizer.vocab_size, d_model=16, n_layers=1, n_heads=2, d_mlp=32,
                    max_seq_len=64, unembed_bias=True)
    model = LanguageModel(config, tokenizer).eval()
    with torch.no_grad():  # make that end token the certain next token
        model.unembed.weight.zero_()
        model.unembed.bias.zero_()
        model.unembed.bias[end] = 10.0
    steps = list(generation_steps(model, PROMPT, max_new_tokens=5))
    assert [s.new_id for s in steps] == [end]
    assert len(list(generation_steps(model, PROMPT, max_new_tokens=5, stop_on_eos=False))) == 5
