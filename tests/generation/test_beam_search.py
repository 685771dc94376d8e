"""Beam search against HF ``generate(num_beams=n, do_sample=False)`` on a tiny random Llama."""

from __future__ import annotations

import pytest
import torch
from generation_toys import hf_byte_tokenizer, one_torch_thread, sharpened_llama_pair  # noqa: F401 (autouse fixture)

from lucidlm.generation import generate
from lucidlm.generation.beam_search import beam_search

transformers = pytest.importorskip("transformers")

EOS = 256
MAX_NEW = 12


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return sharpened_llama_pair(tmp_path_factory.mktemp("tiny_llama"), EOS)


def hf_beam(hf, prompt, **kwargs):
    out = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=MAX_NEW, eos_token_id=EOS,
                      pad_token_id=EOS, **kwargs)[0, len(prompt):].tolist()
    return out[:out.index(EOS) + 1] if EOS in out else out


PROMPTS = [[5, 6, 7], [100, 20, 30, 40, 50], [1], [250, 3, 3, 3, 9, 80, 81]]


@pytest.mark.parametrize("num_beams", [2, 4])
@pytest.mark.parametrize("length_penalty", [1.0, 0.0, 2.0])
def test_beam_search_matches_hf(pair, num_beams, length_penalty):
    hf, ours = pair
    finished_early = 0
    for prompt in PROMPTS:
        expected = hf_beam(hf, prompt, num_beams=num_beams, length_penalty=length_penalty)
        result = generate(ours, prompt, num_beams=num_beams, length_penalty=length_penalty, max_new_tokens=MAX_NEW)
        assert result.token_ids == expected, prompt
        finished_early += expected[-1] == EOS
        assert result.finish_reason == ("eos" if expected[-1] == EOS else "length")
    if length_penalty <= 1.0:  # (2.0 rewards length so much that the full-length beams win)
        assert finished_early >= 1  # the EOS paths were exercised


@pytest.mark.parametrize("early_stopping", [True, "never"])
def test_early_stopping_modes_match_hf(pair, early_stopping):
    hf, ours = pair
    for prompt in PROMPTS:
        expected = hf_beam(hf, prompt, num_beams=3, early_stopping=early_stopping)
        ids, _ = beam_search(ours, prompt, num_beams=3, max_new_tokens=MAX_NEW, eos_ids=[EOS],
                             early_stopping=early_stopping)
        assert ids == expected, prompt


def test_beam_search_with_repetition_penalty_matches_hf(pair):
    hf, ours = pair
    for prompt in PROMPTS:
        expected = hf_beam(hf, prompt, num_beams=3, repetition_penalty=1.5)
        result = generate(ours, prompt, num_beams=3, repetition_penalty=1.5, max_new_tokens=MAX_NEW)
        assert result.token_ids == expected, prompt


# Stop strings the beams of these prompts write (found by listing them); "]}" and "VA" span two tokens.
STOP_CASES = [([72, 105], ["]", "}", "c", "m", "]}"]), ([65, 66, 67], ["A", "V", "`", "m", "O", "VA"])]


@pytest.mark.parametrize("num_beams", [2, 3, 4])
def test_stop_strings_end_beams_as_in_hf(pair, num_beams):
    """A beam that writes a stop string is a finished hypothesis, as with HF's ``stop_strings``:
    it competes on score with the others. Cutting the best of a search that ignored stop
    strings returned another sequence in 105 of 306 such cases."""
    hf, ours = pair
    tokenizer = hf_byte_tokenizer()
    stopped = 0
    for prompt, stops in STOP_CASES:
        for stop, length_penalty in [(s, lp) for s in stops for lp in (1.0, 0.0)]:
            expected = hf_beam(hf, prompt, num_beams=num_beams, length_penalty=length_penalty, stop_strings=[stop],
                               tokenizer=tokenizer)
            result = generate(ours, prompt, num_beams=num_beams, length_penalty=length_penalty,
                              max_new_tokens=MAX_NEW, stop=stop)
            assert result.token_ids == expected, (prompt, stop, length_penalty)
            hf_text = tokenizer.decode(expected, skip_special_tokens=True)
            if stop in hf_text:
                stopped += 1
                assert result.finish_reason == "stop" and result.text == hf_text[:hf_text.index(stop)]
            else:
                assert result.finish_reason == ("eos" if expected[-1] == EOS else "length")
    assert stopped >= 3  # the stop strings really ended beams


def test_one_beam_is_greedy_and_beams_beat_greedy_on_score(pair):
    _, ours = pair
    prompt = PROMPTS[1]
    greedy = generate(ours, prompt, temperature=0, max_new_tokens=MAX_NEW, stop_on_eos=False).token_ids
    ids, score = beam_search(ours, prompt, num_beams=1, max_new_tokens=MAX_NEW)
    assert ids == greedy
    _, score4 = beam_search(ours, prompt, num_beams=4, max_new_tokens=MAX_NEW)
    assert score4 >= score - 1e-6


def test_cache_reorder_moves_only_the_written_slots_of_rows_that_change(pair, monkeypatch):
    """A step's cache reorder gathers, per layer, the rows whose beam came from another one, over
    the slots written so far: HF's reorder gathers every row's keys and values so far once.
    Gathering the whole static cache (every row, every slot, written or not) was ~3x that for
    4 beams on a chat prompt. The gathers are counted with torch's dispatcher, their expected
    size from the beam indices and the prompt length alone."""
    from torch.utils._python_dispatch import TorchDispatchMode

    _, ours = pair
    config = ours.config
    gathered, needed = [], []

    class CountGathers(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.overloadpacket is torch.ops.aten.index_select:
                gathered[-1] += out.numel()
            return out

    reorder = ours.reorder_kv_cache

    def counted(rows, *rest):
        # the prompt's slots copied from the one row that ran it to every beam, then each step's
        # reorder: the prompt, then one token a step before this reorder
        slots = len(PROMPTS[3]) + max(len(needed) - 1, 0)
        moved = sum(int(r) != i for i, r in enumerate(rows.tolist()))
        needed.append(2 * config.n_layers * moved * config.n_kv_heads * slots * config.head_dim)  # k and v
        gathered.append(0)
        with CountGathers():
            reorder(rows, *rest)

    monkeypatch.setattr(ours, "reorder_kv_cache", counted)
    beam_search(ours, PROMPTS[3], num_beams=4, max_new_tokens=MAX_NEW)
    assert len(needed) >= 3 and sum(needed) > 0
    assert gathered == needed
    assert needed[0] == 2 * config.n_layers * 3 * config.n_kv_heads * len(PROMPTS[3]) * config.head_dim  # 3 copies


def test_the_prompt_runs_once_for_every_beam(pair):
    """The beams start as the same prompt: it runs in one row, whose cache slots are copied to the
    others (the test above counts the copy), instead of once per beam; the ids and scores stay
    transformers' (the tests above)."""
    _, ours = pair
    shapes = []
    handle = ours.embed.register_forward_hook(lambda module, args, out: shapes.append(tuple(args[0].shape)))
    try:
        beam_search(ours, PROMPTS[3], num_beams=4, max_new_tokens=3)
    finally:
        handle.remove()
    assert shapes[0] == (1, len(PROMPTS[3]))  # the prompt's pass: one row
    assert all(shape == (4, 1) for shape in shapes[1:]) and len(shapes) > 1  # then every beam, a token a step


def test_min_new_tokens_holds_in_beam_search_as_in_hf(pair):
    """min_new_tokens was dropped on the way to beam search: beams ended at EOS before it.
    transformers masks EOS in the log-probs it ranks until that many tokens are out."""
    hf, ours = pair
    short = 0
    for prompt in PROMPTS:
        for min_new in (3, 6):
            expected = hf_beam(hf, prompt, num_beams=3, min_new_tokens=min_new)
            result = generate(ours, prompt, num_beams=3, min_new_tokens=min_new, max_new_tokens=MAX_NEW)
            assert result.token_ids == expected, (prompt, min_new)
            plain = hf_beam(hf, prompt, num_beams=3)
            short += EOS in plain and len(plain) < min_new + 1  # the rule changed this search
    assert short >= 1


def test_a_one_row_tensor_is_one_prompt_as_in_hf(pair):
    """``hf.generate(input_ids, num_beams=n)`` with a (1, T) tensor is how transformers users
    ask for beams: the same tensor here gives the same beam, as a list of one result (a batch's
    answer). Two rows are still refused by name."""
    from lucidlm.errors import GenerationError

    hf, ours = pair
    for prompt in PROMPTS:
        results = generate(ours, torch.tensor([prompt]), num_beams=3, max_new_tokens=MAX_NEW)
        assert isinstance(results, list) and len(results) == 1
        assert results[0].token_ids == hf_beam(hf, prompt, num_beams=3), prompt
    with pytest.raises(GenerationError, match="beam search takes one prompt at a time, not a batch of 2"):
        generate(ours, torch.tensor([PROMPTS[0], PROMPTS[0]]), num_beams=3)
