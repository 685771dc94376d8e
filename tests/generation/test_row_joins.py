"""Continuous batching (``generation/row_joins.py``): prompts that join a batch under way, taking
over a row that has ended or adding a row, decode what they decode alone.

On the embedded SmolLM2 (``lucidlm.load()``, lucidlm's CPU kernels) a joined row's logits are
compared with ``==`` to the same prompt's in a session of its own, step by step, and so are
the rows that were decoding when it joined (the join runs its prompt in cache row 0, and puts
row 0's slots back). On the float32 SmolLM2, the joined rows' greedy tokens are held to
transformers' ``generate``.
"""

from __future__ import annotations

import pytest
import torch
from generation_toys import one_torch_thread  # noqa: F401 (autouse fixture)

from lucidlm.errors import GenerationError
from lucidlm.generation import generate
from lucidlm.generation.batch_run import BatchRun
from lucidlm.generation.decode import DecodeSession
from lucidlm.generation.defaults import apply_sampling_defaults
from lucidlm.generation.request import make_request, prompt_ids
from lucidlm.generation.row_joins import RowJoins

PROMPTS = ["The capital of France is", "Once upon a time, in a small village,", "def fibonacci(n):",
           "List of planets: Mercury, Venus,", "Water boils at", "The three primary colors are"]


def ids_of(model, prompt):
    return prompt_ids(model, prompt, chat=False)


def alone_logits(model, ids, steps):
    """The logits (V,) of ``steps`` greedy steps of ``ids`` in a session of its own."""
    out = []
    with DecodeSession(model, [ids], capacity=len(ids) + steps) as session:
        logits = session.prefill()
        for _ in range(steps):
            out.append(logits[0].clone())
            logits = session.step(logits.argmax(-1))
    return out


def test_joined_rows_and_the_rows_beside_them_decode_their_alone_bits(smollm2_default):
    """Row 0 decodes throughout; at step 5 a prompt takes over row 1 (ended) and another adds
    row 3; at step 9 one takes over row 0 itself. Every row's logits equal its alone's at
    every step, to the bit."""
    model = smollm2_default
    first = [ids_of(model, p) for p in PROMPTS[:3]]
    joins = {5: [(1, ids_of(model, PROMPTS[3])), (3, ids_of(model, PROMPTS[4]))],
             9: [(0, ids_of(model, PROMPTS[5]))]}
    steps = 16
    seen: dict[tuple[int, int], list[torch.Tensor]] = {}  # (row, step joined) -> its logits, step by step
    owner = {row: (row, 0, ids) for row, ids in enumerate(first)}  # row -> (row, step joined, prompt)
    with DecodeSession(model, first, capacity=64, joinable=True) as session:
        logits = session.prefill()
        for t in range(steps):
            for row, (_, born, _) in owner.items():
                seen.setdefault((row, born), []).append(logits[row].clone())
            logits = session.step(logits.argmax(-1))
            for row, ids in joins.get(t + 1, []):
                row_logits = session.join_row(row, ids)
                logits = torch.cat([logits, row_logits[None]]) if row == len(logits) else logits.clone()
                logits[row] = row_logits
                owner[row] = (row, t + 1, ids)
                seen[(row, t + 1)] = []
        assert session.batch_size == 4
    prompts = {(0, 0): first[0], (1, 0): first[1], (2, 0): first[2], (1, 5): joins[5][0][1],
               (3, 5): joins[5][1][1], (0, 9): joins[9][0][1]}
    for key, ids in prompts.items():
        got = seen[key]
        want = alone_logits(model, ids, len(got))
        assert len(got) > 0 and all(torch.equal(g, w) for g, w in zip(got, want)), key


def greedy_request(model, **options):
    request = make_request(apply_sampling_defaults(model, {"temperature": 0, **options}))
    request.use_model(model)
    return request


def run_with_joins(model, request, first, later, max_rows, join_every=3, room=64):
    """A BatchRun of ``first`` ((prompt, budget, stops) each) that takes ``later`` ones as rows
    free up, one join at most every ``join_every`` steps; (prompt, result, joined) per request."""
    run = BatchRun(model, [ids_of(model, p) for p, _, _ in first], request, [n for _, n, _ in first],
                   [s for _, _, s in first], join_room=room, max_rows=max_rows)
    queue = list(later)
    owner = {row: (case, False) for row, case in enumerate(first)}
    texts: dict[int, str] = {}
    done = []
    for step, pieces in enumerate(run.pieces()):
        for piece in pieces:
            texts[piece.row] = texts.get(piece.row, "") + piece.text
            if piece.result is not None:
                done.append((owner[piece.row], piece.result, texts.pop(piece.row)))
        if queue and step % join_every == join_every - 1:
            prompt, n, stop = queue[0]
            rows = run.join([ids_of(model, prompt)], [n], [stop])
            if rows is not None:
                owner[rows[0]] = (queue.pop(0), True)
    assert not queue, "every later request joined"
    return done


def test_rows_that_join_end_as_they_would_alone(smollm2_default):
    """Budgets, stop strings and EOS per row, rows taken over and rows added: each result is
    generate()'s on that request alone, and its pieces add up to its text."""
    model = smollm2_default
    first = [("The capital of France is", 12, [" Paris"]), ("Once upon a time, in a small village,", 30, [])]
    later = [("def fibonacci(n):", 5, ["\n\n"]), ("List of planets: Mercury, Venus,", 16, [" Mars", "Jupiter"]),
             ("Water boils at", 20, []), ("The three primary colors are", 9, []), ("Hello, my name is", 14, ["."])]
    done = run_with_joins(model, greedy_request(model), first, later, max_rows=3)
    assert len(done) == len(first) + len(later) and sum(joined for (_, joined), _, _ in done) == len(later)
    reasons = set()
    for ((prompt, n, stop), _), got, text in done:
        want = generate(model, prompt, max_new_tokens=n, stop=stop, temperature=0)
        assert (got.token_ids, got.text, got.finish_reason, got.prompt_ids) == \
            (want.token_ids, want.text, want.finish_reason, want.prompt_ids), prompt
        assert text == want.text
        assert got.seconds >= (got.prompt_seconds or 0) >= 0
        reasons.add(got.finish_reason)
    assert reasons == {"stop", "length"}


def test_penalties_and_min_new_tokens_count_a_joined_rows_own_tokens(smollm2_default):
    """The repetition penalty and the n-gram ban look back over the row's own prompt and tokens
    only, and min_new_tokens keeps EOS away from a row's first tokens counted from its join."""
    model = smollm2_default
    options = dict(repetition_penalty=1.3, no_repeat_ngram_size=3, min_new_tokens=6)
    chat = "Is the sky blue? Answer yes or no."
    request = greedy_request(model, **options)
    first = [("Once upon a time, in a small village,", 40, [])]
    later = [("The capital of France is", 18, []), ("Water boils at", 12, [])]
    done = run_with_joins(model, request, first, later, max_rows=2, join_every=4)
    for ((prompt, n, _), _), got, _ in done:
        want = generate(model, prompt, max_new_tokens=n, temperature=0, **options)
        assert got.token_ids == want.token_ids, prompt
    # min_new_tokens: a chat answer that ends on EOS at once without it, joined late
    short = prompt_ids(model, chat, chat=True)
    without = generate(model, chat, chat=True, max_new_tokens=20, temperature=0)
    assert without.finish_reason == "eos" and len(without.token_ids) < 6
    run = BatchRun(model, [ids_of(model, first[0][0])], request, [60], [[]], join_room=64, max_rows=2)
    joined_row = None
    for step, pieces in enumerate(run.pieces()):
        if step == 30:
            joined_row = run.join([short], [20], [[]])[0]
    want = generate(model, chat, chat=True, max_new_tokens=20, temperature=0, **options)
    got = run.results[joined_row]
    assert (got.token_ids, got.finish_reason) == (want.token_ids, want.finish_reason)
    assert len(got.token_ids) >= 6


def test_joined_rows_follow_transformers_greedy_decoding(smollm2, hf_smollm2):
    """The float32 SmolLM2 against transformers' generate(): joined rows, and the row they
    joined beside, give its greedy tokens."""
    hf_model, hf_tokenizer = hf_smollm2
    model = smollm2
    first = [("Once upon a time, in a small village,", 24, [])]
    later = [("The capital of France is", 10, []), ("List of planets: Mercury, Venus,", 10, []),
             ("def fibonacci(n):", 10, [])]
    done = run_with_joins(model, greedy_request(model), first, later, max_rows=2, join_every=2)
    for ((prompt, n, _), _), got, _ in done:
        ids = torch.tensor([hf_tokenizer.encode(prompt)])
        with torch.no_grad():
            want = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                                     pad_token_id=hf_tokenizer.eos_token_id)[0, ids.shape[1]:].tolist()
        assert got.token_ids == want[:len(got.token_ids)] and len(got.token_ids) == n, prompt


def test_what_may_join_and_when(smollm2_default):
    model = smollm2_default
    joins = RowJoins(capacity=40)
    assert joins.room(3) == 0  # not running yet
    joins.slot = 10
    assert (joins.room(10), joins.room(11), joins.room(0)) == (31, 0, 0)  # a prompt no longer than the clock
    with pytest.raises(ValueError, match="cannot join"):
        joins.add(0, [1] * 5, 32)
    joins.add(0, [1] * 5, 31)
    with pytest.raises(ValueError, match="already has a prompt"):
        joins.add(0, [1] * 5, 3)
    joins.rows = 2
    pending, keep, shift = joins.take()
    assert [j.row for j in pending] == [0] and keep == 2 and shift == 0 and joins.take() == ([], None, 0)

    short, long = ids_of(model, "Water boils at"), ids_of(model, PROMPTS[1])
    run = BatchRun(model, [short], greedy_request(model), [6], [[]], join_room=8, max_rows=2)
    assert run.join([short], [3], [[]]) is None  # before the batch has started
    steps = run.pieces()
    next(steps)  # step 0: the clock is past the short prompt only
    assert run.join([long], [3], [[]]) is None  # longer than the batch has run
    assert run.join([short], [14], [[]]) is None  # past the cache (6 + 8 slots after the prompt)
    assert run.join([short, short], [3, 3], [[], []]) is None  # one free row only
    assert run.join([short], [3], [[]]) == [1]
    assert run.join([short], [3], [[]]) is None  # none left
    list(steps)
    assert run.join([short], [1], [[]]) is None  # over
    assert run.results[1].token_ids == generate(model, "Water boils at", max_new_tokens=3, temperature=0).token_ids

    # an open-ended request (a chat without max_tokens) joins only a batch whose cache is the whole context
    whole = BatchRun(model, [short], greedy_request(model), [model.config.max_seq_len], [[]], join_room=8, max_rows=2)
    steps = whole.pieces()
    next(steps)
    next(steps)  # one step past the prompt: less room than alone has (a step earlier it fits exactly, cut as alone)
    assert whole.join([short], [model.config.max_seq_len], [[]]) is None
    assert whole.join([short], [model.config.max_seq_len], [[]], open_ended=True) == [1]
    steps.close()


@pytest.mark.parametrize("options", [{"logprobs": 2}, {"presence_penalty": 0.5}, {"frequency_penalty": 0.5}])
def test_batches_whose_settings_count_from_the_first_step_take_no_joins(smollm2_default, options):
    model = smollm2_default
    request = greedy_request(model, **options)
    assert not BatchRun.can_take_joins(model, request)
    with pytest.raises(ValueError, match="rows cannot join"):
        BatchRun(model, [ids_of(model, "Hi")], request, [4], [[]], join_room=8)
    assert BatchRun.can_take_joins(model, greedy_request(model, repetition_penalty=1.2))


def test_a_session_refuses_joins_it_cannot_take(smollm2_default):
    model = smollm2_default
    ids = ids_of(model, "Water boils at")
    with DecodeSession(model, [ids], capacity=16) as session:
        session.prefill()
        with pytest.raises(GenerationError, match="joinable=True"):
            session.join_row(0, ids)
    with DecodeSession(model, [ids], capacity=16, joinable=True) as session:
        with pytest.raises(GenerationError, match="joinable=True"):
            session.join_row(0, ids)  # before its prompt
        session.prefill()
        with pytest.raises(GenerationError, match="cannot join row 2"):
            session.join_row(2, ids)  # rows are added one at a time, at the end
        with pytest.raises(GenerationError, match="5-token prompt cannot join"):
            session.join_row(0, ids + ids[:2])  # longer than the slots before the next one


def test_a_batch_whose_last_rows_ended_decodes_fewer_rows_and_grows_again(smollm2_default):
    """Rows 1 and 2 end early: the cache keeps row 0 only while it decodes on alone; a prompt
    that joins then adds row 1 back. Each answer is generate()'s alone."""
    model = smollm2_default
    cases = [("Once upon a time, in a small village,", 40), ("Water boils at", 4), ("def fibonacci(n):", 6)]
    run = BatchRun(model, [ids_of(model, p) for p, _ in cases], greedy_request(model), [n for _, n in cases],
                   [[], [], []], join_room=32, max_rows=3)
    rows_seen, joined = [], None
    for step, _ in enumerate(run.pieces()):
        rows_seen.append(model.kv_caches[0].batch_size)
        if step == 15:
            joined = run.join([ids_of(model, "The capital of France is")], [10], [[]])
    assert joined == [1]
    assert rows_seen[:5] == [3] * 5 and rows_seen[8:16] == [1] * 8 and rows_seen[17:26] == [2] * 9
    for (prompt, n), got in zip(cases, run.results):
        if prompt != "Water boils at":
            assert got.token_ids == generate(model, prompt, max_new_tokens=n, temperature=0).token_ids
    assert run.results[1].token_ids == generate(model, "The capital of France is", max_new_tokens=10,
                                                temperature=0).token_ids


def test_a_joined_row_ends_at_the_context_end_as_it_does_alone(smollm2_default, monkeypatch):
    """A batch whose cache is the whole context (a 40-token one here): a prompt of n tokens that
    joins when the clock is at n has room for context - n + 1 tokens (the last is never fed
    back), but alone it gets context - n, prompt and answer within the context. A joined row is
    cut as alone is, asked for that one token more or open-ended."""
    model = smollm2_default
    monkeypatch.setattr(model.config, "max_seq_len", 40)
    lead, joiner = ids_of(model, "Hi"), ids_of(model, "The quick brown fox")
    n = len(joiner)
    for open_ended in (False, True):
        run = BatchRun(model, [lead], greedy_request(model), [40], [[]], join_room=64, max_rows=2)
        assert run.joins.capacity == 40
        row = None
        for _ in run.pieces():
            if row is None and run.joins.slot == n:
                row = run.join([joiner], [40 if open_ended else 40 - n + 1], [[]], open_ended=open_ended)[0]
        want = generate(model, "The quick brown fox", max_new_tokens=40, temperature=0)
        got = run.results[row]
        assert len(want.token_ids) == 40 - n and want.finish_reason == "length"
        assert (got.token_ids, got.finish_reason) == (want.token_ids, want.finish_reason), open_ended


def test_rows_decode_their_alone_bits_across_a_slide(smollm2_default):
    """Row 1 (the longest prompt, from slot 0) is taken over at step 4 by a shorter prompt; at
    step 8 no row that goes on reads the first slots any more, and the batch slides left by
    them, then a third prompt adds row 2. The cache is too short for 16 steps without the
    slide. Every row's logits equal its alone's at every step, across the slide, to the bit."""
    model = smollm2_default
    first = [ids_of(model, PROMPTS[0]), ids_of(model, PROMPTS[1])]
    L, steps = len(first[1]), 16
    later = {4: (1, ids_of(model, PROMPTS[4])), 8: (2, ids_of(model, PROMPTS[5]))}
    seen: dict[tuple[int, int], list[torch.Tensor]] = {}
    owner = {0: 0, 1: 0}  # row -> the step its prompt joined at
    shift = min(L - len(first[0]), L + 4 - len(later[4][1]))  # the first real slots of the rows that go on
    assert shift >= 4
    with DecodeSession(model, first, capacity=L + steps - shift, joinable=True) as session:
        logits = session.prefill()
        for t in range(steps):
            for row, born in owner.items():
                seen.setdefault((row, born), []).append(logits[row].clone())
            logits = session.step(logits.argmax(-1))
            if t + 1 == 8:
                session.slide(shift)
                assert session.next_slot == L + 8 - shift
            if t + 1 in later:
                row, ids = later[t + 1]
                row_logits = session.join_row(row, ids)
                logits = torch.cat([logits, row_logits[None]]) if row == len(logits) else logits.clone()
                logits[row] = row_logits
                owner[row] = t + 1
    prompts = {(0, 0): first[0], (1, 0): first[1], (1, 4): later[4][1], (2, 8): later[8][1]}
    for key, ids in prompts.items():
        got = seen[key]
        want = alone_logits(model, ids, len(got))
        assert len(got) > 0 and all(torch.equal(g, w) for g, w in zip(got, want)), key


def test_room_counts_the_slide_the_batch_allows(smollm2_default):
    """A join may have the slots that no row going on reads (the slack), as long as its prompt
    still fits before the clock after the slide, and no prompt queued before it loses the slide
    it needs."""
    joins = RowJoins(capacity=40)
    joins.slot, joins.slack = 30, 12
    assert (joins.room(10), joins.room(25), joins.room(30)) == (23, 16, 11)  # slides of 12, 5 and 0
    joins.add(1, [1] * 10, 23)  # needs the whole slack
    assert joins.room(25) == 0 and joins.room(5) == 23  # a 25-token prompt would allow a slide of 5 only
    saved = joins.save()
    joins.add(2, [1] * 5, 20)
    joins.restore(saved)
    pending, keep, shift = joins.take()
    assert [j.row for j in pending] == [1] and keep is None and shift == 12
    joins.add(1, [1] * 10, 11)  # fits without a slide: none made
    assert joins.take()[2] == 0


def test_a_batch_under_steady_joins_slides_and_each_answer_is_alone(smollm2_default, monkeypatch):
    """Requests join one after another as rows end, into a batch whose cache holds a few more
    slots than its first rows need: without slides the later ones could not join. Each result
    is generate()'s on that request alone, with a repetition penalty and an n-gram ban, which
    read each row's tokens by slot."""
    model = smollm2_default
    slides = []
    slide = DecodeSession.slide
    monkeypatch.setattr(DecodeSession, "slide", lambda self, shift: (slides.append(shift), slide(self, shift)))
    # Row 1 decodes until its 40 tokens fill the cache but for 6 slots (min_new_tokens keeps EOS away:
    # rows end on their budgets); the first slide comes while it runs, as far as its first real slot
    # (one slot further would cut its prompt), the next once it has ended.
    first = [("Once upon a time, in a small village,", 6, []), ("The capital of France is", 40, [])]
    later = [(p, 14, []) for p in ("def fibonacci(n):", "List of planets: Mercury, Venus,", "Water boils at",
                                   "The three primary colors are", "Hello, my name is", "The best way to learn is")]
    options = dict(repetition_penalty=1.3, no_repeat_ngram_size=3, min_new_tokens=40)  # they read tokens by slot
    done = run_with_joins(model, greedy_request(model, **options), first, later, max_rows=2, join_every=2, room=6)
    assert len(slides) >= 2
    for ((prompt, n, stop), _), got, text in done:
        want = generate(model, prompt, max_new_tokens=n, stop=stop, temperature=0, **options)
        assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, want.finish_reason), prompt


MORE_PROMPTS = PROMPTS + ["Hi", "Hello, my name is", "The best way to learn is",
                          "In 1492, Columbus sailed across the Atlantic Ocean to"]


@pytest.mark.parametrize("seed", [2, 7, 9, 10])
def test_random_schedules_that_slide_give_each_answer_alone(smollm2_default, monkeypatch, seed):
    """Random first rows, budgets, cache room and join times (3 rows at most, rows ended by their
    budgets: min_new_tokens keeps EOS away), each schedule sliding the batch two to four times,
    rows decoding across several slides: every answer is generate()'s alone (with an n-gram ban,
    which reads the rows' tokens by slot)."""
    import random

    model = smollm2_default
    slides = []
    slide = DecodeSession.slide
    monkeypatch.setattr(DecodeSession, "slide", lambda self, shift: (slides.append(shift), slide(self, shift)))
    rng = random.Random(seed)
    first = [(rng.choice(MORE_PROMPTS), rng.randint(3, 60)) for _ in range(rng.randint(2, 3))]
    later = [(rng.choice(MORE_PROMPTS), rng.randint(5, 30)) for _ in range(12)]
    options = dict(min_new_tokens=60, no_repeat_ngram_size=3)
    run = BatchRun(model, [ids_of(model, p) for p, _ in first], greedy_request(model, **options),
                   [n for _, n in first], [[] for _ in first], join_room=rng.randint(1, 8), max_rows=3)
    owner = dict(enumerate(first))
    done, every = [], rng.randint(1, 3)
    for step, pieces in enumerate(run.pieces()):
        done += [(owner[piece.row], piece.result) for piece in pieces if piece.result is not None]
        if later and step % every == 0:
            rows = run.join([ids_of(model, later[0][0])], [later[0][1]], [[]])
            if rows is not None:
                owner[rows[0]] = later.pop(0)
    assert len(slides) >= 2 and len(done) >= 8
    for (prompt, n), got in done:
        assert got.token_ids == generate(model, prompt, max_new_tokens=n, temperature=0, **options).token_ids, prompt


def test_a_prompt_that_asks_to_join_as_the_cache_fills_does_not_fail_the_batch(smollm2_default):
    """A joined row whose answer reaches one slot past the cache (its budget is all the room it
    had) is at its last token: the step that would take a join now feeds that token at the
    cache's end, which no slide made before it can move. A prompt asking to join then (the
    slack is the ended row's first slot, so the slide looks possible) waits for the next batch
    instead of failing the step, and every answer is still alone's."""
    model = smollm2_default
    lead, joiner, late = ids_of(model, PROMPTS[1]), ids_of(model, "Water boils at"), ids_of(model, "Hi")
    run = BatchRun(model, [lead], greedy_request(model, min_new_tokens=100), [6], [[]], join_room=4, max_rows=2)
    row, asked = None, None
    for step, _ in enumerate(run.pieces()):
        if step == 1:
            room = run.joins.room(len(joiner))
            row = run.join([joiner], [room], [[]])[0]
        elif row is not None and asked is None and run.results[row] is not None:
            assert run.joins.slot == run.joins.capacity + 1 and run.joins.slack > 0  # its last token at the end
            asked = run.join([late], [1], [[]])
    assert asked is None
    want = generate(model, "Water boils at", max_new_tokens=room, temperature=0, min_new_tokens=100)
    assert run.results[row].token_ids == want.token_ids
