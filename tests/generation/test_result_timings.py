"""``GenerationResult`` carries its timings (time to the first token, whole generation) and
displays in Jupyter as escaped prompt + highlighted output + finish reason + numbers."""

from __future__ import annotations

import time

import pytest
from generation_toys import ScriptedModel, byte_tokenizer, one_torch_thread, toy_model  # noqa: F401 (autouse fixture)
from html_checks import assert_css_scoped, element_ids

from lucidlm.commands.generate import _json_result
from lucidlm.generation import GenerationResult, generate, stream

HOSTILE = "<script>alert(\"x&y\")</script> & 'q' </div>"


def scripted(text: str, prompt: str = "go", tail: tuple[int, ...] = ()) -> ScriptedModel:
    tok = byte_tokenizer()
    return ScriptedModel(tok, list(text.encode()) + list(tail), prompt_len=len(prompt.encode()))


def assert_consistent(result: GenerationResult) -> None:
    n = len(result.token_ids)
    assert result.seconds is not None and result.seconds > 0
    assert result.tokens_per_second == pytest.approx(n / result.seconds)
    if n:
        assert result.prompt_seconds is not None and 0 < result.prompt_seconds <= result.seconds
    if n >= 2 and result.seconds > result.prompt_seconds:
        assert result.decode_tokens_per_second == pytest.approx((n - 1) / (result.seconds - result.prompt_seconds))


def test_generate_fills_the_timings():
    model = toy_model(seed=0)
    result = generate(model, "Hello", max_new_tokens=8, temperature=0, stop_on_eos=False)
    assert len(result.token_ids) == 8 and result.finish_reason == "length"
    assert_consistent(result)


def test_a_batch_fills_each_rows_timings():
    model = toy_model(seed=0)
    results = generate(model, ["Hello", "Hi there"], max_new_tokens=6, temperature=0, stop_on_eos=False)
    for result in results:
        assert_consistent(result)
    assert results[0].prompt_seconds == results[1].prompt_seconds  # one first step for every row


def test_a_batch_row_that_stops_early_has_its_own_end():
    model = scripted("ab", tail=(256,))  # EOS after two tokens, in every row
    results = generate(model, ["go", "go"], max_new_tokens=20, temperature=0)
    for result in results:
        assert result.finish_reason == "eos" and len(result.token_ids) == 3
        assert_consistent(result)


def test_a_stream_leaves_out_the_time_the_caller_holds_the_pieces():
    model = scripted("abcdefgh")
    pieces = stream(model, "go", max_new_tokens=8, temperature=0)
    held = 0.0
    for _ in pieces:
        time.sleep(0.05)
        held += 0.05
    result = pieces.result
    assert result.text == "abcdefgh"
    assert_consistent(result)
    assert result.seconds < held  # 8 scripted tokens take far less than 8 x 50 ms


def test_beam_search_has_a_total_time_but_no_first_token_time():
    model = toy_model(seed=0)
    result = generate(model, "Hello", max_new_tokens=5, num_beams=2, stop_on_eos=False)
    assert result.prompt_seconds is None and result.decode_tokens_per_second is None
    assert result.seconds > 0
    assert result.tokens_per_second == pytest.approx(len(result.token_ids) / result.seconds)


def test_a_hand_built_result_still_works_without_timings():
    result = GenerationResult([1, 2], "ab", [3], "eos")
    assert result.seconds is None and result.prompt_seconds is None
    assert result.tokens_per_second is None and result.decode_tokens_per_second is None
    assert "eos" in result._repr_html_()


def test_rates_follow_the_documented_formulas():
    result = GenerationResult(list(range(11)), "x", [], "length", prompt_seconds=0.5, seconds=2.5)
    assert result.tokens_per_second == pytest.approx(11 / 2.5)
    assert result.decode_tokens_per_second == pytest.approx(10 / 2.0)


def test_cli_json_reports_the_results_own_time():
    result = GenerationResult([1, 2, 3, 4], "abcd", [5], "length", prompt_seconds=0.1, seconds=2.0)
    data = _json_result(result, 0.25, 99.0)
    assert data["seconds"] == 2.0 and data["tokens_per_second"] == 2.0 and data["load_seconds"] == 0.25
    assert data["new_tokens"] == 4 and data["prompt_tokens"] == 1
    legacy = _json_result(GenerationResult([1, 2], "ab", [5]), 0.0, 4.0)  # no time of its own: the wall time
    assert legacy["seconds"] == 4.0 and legacy["tokens_per_second"] == 0.5


# -- the Jupyter display --



def test_result_html_escapes_prompt_and_output_and_shows_the_numbers():
    prompt = "<b>\"P&Q'</b>"
    model = scripted(HOSTILE, prompt=prompt, tail=(256,))
    result = generate(model, prompt, max_new_tokens=200, temperature=0)
    assert result.text == HOSTILE and result.finish_reason == "eos"
    page = result._repr_html_()
    assert HOSTILE not in page and "<script>" not in page and prompt not in page
    assert '<span class="output">' + __import__("html").escape(HOSTILE) + "</span>" in page
    assert '<span class="prompt">' + __import__("html").escape(prompt) + "</span>" in page
    assert "finish reason: <b>eos</b>" in page
    assert f"{len(result.token_ids)} new tokens" in page and "tok/s" in page and f"{result.seconds:.3f} s" in page


def test_result_html_has_a_fresh_id_and_scoped_css():
    result = GenerationResult([104, 105], "hi", [1, 2], "length", prompt_seconds=0.1, seconds=0.3)
    first, second = result._repr_html_(), result._repr_html_()
    (id1,), (id2,) = element_ids(first), element_ids(second)
    assert id1 != id2 and id1.startswith("lucidlm-result-")
    assert_css_scoped(first, id1)
    assert '<span class="prompt">1 2</span>' in first  # no tokenizer: the prompt's ids
