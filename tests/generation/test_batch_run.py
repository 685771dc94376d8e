"""``BatchRun``: rows with their own token budgets and stop strings, decoded as one batch on the
embedded SmolLM2 (``lucidlm.load()``, what ``lucidlm serve`` batches), each row checked against
``generate`` on that prompt alone."""

from __future__ import annotations

from generation_toys import one_torch_thread  # noqa: F401 (autouse fixture)

from lucidlm.generation import generate
from lucidlm.generation.batch_run import BatchRun, fits_together
from lucidlm.generation.defaults import apply_sampling_defaults
from lucidlm.generation.request import make_request, prompt_ids

# (prompt, max_new_tokens, stop strings): lengths differ, so the shorter prompts are left-padded
ROWS = [("The capital of France is", 12, [" Paris"]),  # ends on its stop string
        ("Once upon a time, in a small village,", 20, []),  # runs its whole budget
        ("def fibonacci(n):", 5, ["\n\n"]),  # a short budget: ends first, the others go on
        ("List of planets: Mercury, Venus,", 16, [" Mars", "Jupiter"])]


def greedy_request(model):
    request = make_request(apply_sampling_defaults(model, {"temperature": 0}))
    request.use_model(model)
    return request


def test_each_row_ends_as_it_would_alone(smollm2_default):
    model = smollm2_default
    rows = [prompt_ids(model, prompt, chat=False) for prompt, _, _ in ROWS]
    run = BatchRun(model, rows, greedy_request(model), [n for _, n, _ in ROWS], [stop for _, _, stop in ROWS])
    texts = ["" for _ in ROWS]
    ended_at = {}
    for step, pieces in enumerate(run.pieces()):
        for piece in pieces:
            assert piece.row not in ended_at, "a row gave text after its result"
            texts[piece.row] += piece.text
            if piece.result is not None:
                ended_at[piece.row] = step
    alone = [generate(model, prompt, max_new_tokens=n, stop=stop, temperature=0) for prompt, n, stop in ROWS]
    assert [r.finish_reason for r in alone] == ["stop", "length", "length", "stop"]  # the cases this test means
    for got, want, text in zip(run.results, alone, texts):
        assert (got.token_ids, got.text, got.finish_reason, got.prompt_ids) == \
            (want.token_ids, want.text, want.finish_reason, want.prompt_ids)
        assert text == want.text  # the pieces join to the text, as a stream's do
    assert ended_at[2] < ended_at[1]  # the 5-token row was answered before the batch ended


def test_a_row_ended_from_outside_stops_and_the_others_go_on(smollm2_default):
    model = smollm2_default
    prompts = ["The capital of France is", "Once upon a time, in a small village,"]
    rows = [prompt_ids(model, p, chat=False) for p in prompts]
    run = BatchRun(model, rows, greedy_request(model), [20, 20], [[], []])
    for step, _ in enumerate(run.pieces()):
        if step == 2:
            run.end_row(0)  # its client went away
    assert len(run.results[0].token_ids) == 3
    assert run.results[1].token_ids == generate(model, prompts[1], max_new_tokens=20, temperature=0).token_ids


def test_fits_together_refuses_a_row_that_padding_would_cut_short(smollm2_default):
    model = smollm2_default
    context = model.config.max_seq_len
    short, long = [1] * 10, [1] * 100
    assert fits_together(model, [short, long], [16, 16])
    assert not fits_together(model, [short, long], [context - 10, 16])  # alone it gets 100 - 10 more
    assert fits_together(model, [long], [context])  # alone, the context cuts it as generate does


def test_a_row_with_no_budget_ends_once_with_nothing_while_the_others_decode(smollm2_default):
    """max_tokens 0 (a client that counts its prompt's tokens, or echoes it) beside a row that
    generates: its one result stays empty, as generate's, and no piece follows it."""
    model = smollm2_default
    prompts = ["Hello there", "The capital of France is"]
    run = BatchRun(model, [prompt_ids(model, p, chat=False) for p in prompts], greedy_request(model), [0, 4],
                   [[], []])
    ends, after_end = [], []
    for pieces in run.pieces():
        for piece in pieces:
            if piece.row in [row for row, _ in ends]:
                after_end.append(piece)
            if piece.result is not None:
                ends.append((piece.row, piece.result))
    first_result = dict(ends)[0]
    assert [row for row, _ in ends] == [0, 1] and after_end == []
    alone = generate(model, prompts[0], max_new_tokens=0, temperature=0)
    assert (first_result.token_ids, first_result.text, first_result.finish_reason) == \
        (alone.token_ids, alone.text, alone.finish_reason) == ([], "", "length")
    assert run.results[1].token_ids == generate(model, prompts[1], max_new_tokens=4, temperature=0).token_ids


def test_a_left_padded_row_gets_exactly_the_bits_it_gets_alone(smollm2_default):
    """Each prompt of a batch is prefilled on its own (``DecodeSession._prefill_each_row``): one
    padded pass rounded differently, ~1e-3 in the log-probs on this model, and took the other
    token where the two likeliest were closer than that ("import numpy as np\\n", token 36: a
    1.3e-3 gap). The log-probs of every token, and its alternatives, equal generate's alone."""
    from lucidlm.generation import generate_batch

    model = smollm2_default
    prompts = ["import numpy as np\n", "The quick brown fox jumps over the lazy dog. The dog",
               "1, 2, 3,", "Q: What is the boiling point of water?\nA:", "Dear Sir,",
               "The history of the Roman Empire begins", "<html>\n<head>", "Paris is"]
    batch = generate_batch(model, prompts, max_new_tokens=48, temperature=0, logprobs=2, stop_on_eos=False)
    assert len({len(r.prompt_ids) for r in batch}) > 4  # left padding of many widths
    for prompt, got in zip(prompts, batch):
        want = generate(model, prompt, max_new_tokens=48, temperature=0, logprobs=2, stop_on_eos=False)
        assert got.token_ids == want.token_ids, prompt
        assert got.logprobs == want.logprobs and got.top_logprobs == want.top_logprobs, prompt  # to the bit
