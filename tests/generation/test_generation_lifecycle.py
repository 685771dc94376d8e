"""What a generation leaves on the model for the next call: its KV cache belongs to one
generation at a time, in one thread at a time. Oracle: the same call on a fresh model."""

from __future__ import annotations

import gc
import threading

import pytest
from generation_toys import toy_model, one_torch_thread  # noqa: F401 (autouse fixture)

from lucidlm.errors import GenerationError
from lucidlm.language_model import LanguageModel

OPTIONS = dict(max_new_tokens=6, temperature=0, stop_on_eos=False)


def test_a_second_thread_cannot_take_the_cache_between_a_step_and_its_owner_check():
    """Without a lock a thread's generate set up its cache after another's owner check and
    before its step: that step read the wrong prompt's keys (wrong tokens, no error)."""
    model, fresh = toy_model(model_cls=LanguageModel), toy_model(model_cls=LanguageModel)
    outcome, this_thread = {}, threading.current_thread()

    def other_thread() -> None:
        try:
            outcome["tokens"] = model.generate("a different prompt", **OPTIONS).token_ids
        except GenerationError as error:
            outcome["error"] = str(error)

    def in_a_decode_step(module, args) -> None:  # runs inside model.step, after the owner check
        if args[0].shape[1] == 1 and threading.current_thread() is this_thread and "started" not in outcome:
            outcome["started"] = True
            thread = threading.Thread(target=other_thread)
            thread.start()
            thread.join(timeout=60)

    handle = model.embed.register_forward_pre_hook(in_a_decode_step)
    try:
        tokens = model.generate("Hello there", **OPTIONS).token_ids
    finally:
        handle.remove()
    assert "another thread is generating on this model" in outcome.get("error", "")
    assert tokens == fresh.generate("Hello there", **OPTIONS).token_ids
    assert model.kv_caches is None
    assert model.generate("a different prompt", **OPTIONS).token_ids == \
        fresh.generate("a different prompt", **OPTIONS).token_ids


def test_a_stream_paused_in_one_thread_refuses_another_and_the_same_thread_takes_over():
    model, fresh = toy_model(model_cls=LanguageModel), toy_model(model_cls=LanguageModel)
    paused, done = threading.Event(), threading.Event()

    def reader() -> None:
        pieces = model.stream("Hello there", **OPTIONS)
        next(pieces)
        paused.set()
        done.wait(timeout=60)
        pieces.close()

    thread = threading.Thread(target=reader)
    thread.start()
    paused.wait(timeout=60)
    try:
        with pytest.raises(GenerationError, match="another thread is generating on this model"):
            model.generate("Hi", **OPTIONS)
    finally:
        done.set()
        thread.join(timeout=60)
    assert model.generate("Hi", **OPTIONS).token_ids == fresh.generate("Hi", **OPTIONS).token_ids
    # within one thread a new generation still takes the cache over from a paused stream
    pieces = model.stream("Hello there", **OPTIONS)
    next(pieces)
    assert model.generate("Hi", **OPTIONS).token_ids == fresh.generate("Hi", **OPTIONS).token_ids
    with pytest.raises(GenerationError, match="another generation ran on this model"):
        next(pieces)


def test_generation_steps_and_a_stream_interleaved_do_not_share_a_cache():
    """generation_steps set up its own cache outside the owner registry: a stream opened between
    two of its steps decoded on, with the walk's cache put back under it (wrong tokens, no
    error). Now the later one owns the cache and the earlier one says so when read again."""
    from lucidlm.inspect import generation_steps

    model, fresh = toy_model(model_cls=LanguageModel), toy_model(model_cls=LanguageModel)
    prompt, other = list(b"Hello there"), list(b"Other prompt!")
    walk = generation_steps(model, prompt, 6, stop_on_eos=False)
    first = next(walk)
    assert [first.new_id] == fresh.generate(prompt, **OPTIONS).token_ids[:1]
    pieces = model.stream(other, **OPTIONS)
    next(pieces)
    with pytest.raises(GenerationError, match="another generation ran on this model"):
        next(walk)
    list(pieces)
    assert pieces.result.token_ids == fresh.generate(other, **OPTIONS).token_ids
    assert model.kv_caches is None
    assert [s.new_id for s in generation_steps(model, prompt, 6, stop_on_eos=False)] == \
        fresh.generate(prompt, **OPTIONS).token_ids


@pytest.mark.parametrize("collected", ["before", "after"])
def test_a_stream_the_garbage_collector_closes_while_a_cache_is_set_up(collected):
    """A stream dropped part-way while held in a reference cycle is closed by the collector, at
    whatever allocation it runs; setting up the next generation's cache allocates under the
    cache lock, and the stream's session took that lock again on closing: a plain Lock hung
    the process for good (Jupyter keeps such cycles through tracebacks and its history).
    Closed just after the new cache is in place, the stream must not take it for its own."""
    import gc

    model, fresh = toy_model(model_cls=LanguageModel), toy_model(model_cls=LanguageModel)
    set_up = model.setup_kv_cache

    def set_up_as_the_collector_runs(*args, **kwargs):  # where an allocation in the set-up would trigger it
        if collected == "before":
            gc.collect()
        set_up(*args, **kwargs)
        if collected == "after":
            gc.collect()

    outcome = {}

    def in_a_thread() -> None:  # a hang stays in this thread, not in the test run
        class Holder:
            pass

        holder = Holder()
        holder.cycle, holder.pieces = holder, model.stream("Hello there", **OPTIONS)
        next(holder.pieces)
        del holder  # only the collector can free it now
        model.setup_kv_cache = set_up_as_the_collector_runs
        outcome["tokens"] = model.generate("Hi", **OPTIONS).token_ids

    was_enabled = gc.isenabled()
    gc.disable()  # no collection before the one inside the set-up
    try:
        thread = threading.Thread(target=in_a_thread, daemon=True)
        thread.start()
        thread.join(timeout=20)
    finally:
        if was_enabled:
            gc.enable()
    assert not thread.is_alive(), "generate hung closing an abandoned stream inside the cache set-up"
    assert outcome["tokens"] == fresh.generate("Hi", **OPTIONS).token_ids
    assert model.kv_caches is None


def test_a_paused_stream_refuses_a_cache_set_up_by_hand_and_leaves_it_alone():
    """run_with_cache(input_pos=...) needs a cache from model.setup_kv_cache; set up while a
    stream was paused, the stream went on decoding against it (the other prompt's keys: wrong
    tokens, no error), and closing the stream then cleared the hand-made cache."""
    import torch

    model, fresh = toy_model(model_cls=LanguageModel), toy_model(model_cls=LanguageModel)
    pieces = model.stream("Hello there", **OPTIONS)
    next(pieces)
    model.setup_kv_cache(1, 64)
    ids = torch.tensor([[5, 6, 7]])
    model.run_with_cache(ids, input_pos=torch.arange(3))
    with pytest.raises(GenerationError, match="KV cache was set up anew or cleared while this generation was paused"):
        next(pieces)
    pieces.close()
    assert model.kv_caches is not None  # still the hand-made one, with its three slots
    logits, _ = model.run_with_cache(torch.tensor([[8]]), input_pos=torch.tensor([3]))
    fresh.setup_kv_cache(1, 64)
    fresh.run_with_cache(ids, input_pos=torch.arange(3))
    expected, _ = fresh.run_with_cache(torch.tensor([[8]]), input_pos=torch.tensor([3]))
    torch.testing.assert_close(logits, expected, rtol=0, atol=0)
    model.clear_kv_cache()
    assert model.generate("Hi", **OPTIONS).token_ids == fresh.generate("Hi", **OPTIONS).token_ids


def test_a_stream_another_thread_dropped_in_a_reference_cycle_does_not_block_the_model():
    """A half-read stream dropped inside a reference cycle (a notebook's traceback keeps one)
    still owned the cache until the collector happened to run: another thread's generate was
    refused as if that stream were still being read."""
    model, fresh = toy_model(model_cls=LanguageModel), toy_model(model_cls=LanguageModel)
    gc_was_enabled = gc.isenabled()
    gc.disable()  # the collector must not run by chance before the second thread asks

    def reader() -> None:
        pieces = model.stream("Hello there", **OPTIONS)
        next(pieces)
        cycle = {"pieces": pieces}
        cycle["self"] = cycle  # only the collector frees this dict, and the stream with it

    try:
        thread = threading.Thread(target=reader)
        thread.start()
        thread.join(timeout=60)
        outcome = {}

        def other_thread() -> None:
            try:
                outcome["tokens"] = model.generate("a different prompt", **OPTIONS).token_ids
            except GenerationError as error:
                outcome["error"] = str(error)

        second = threading.Thread(target=other_thread)
        second.start()
        second.join(timeout=60)
    finally:
        if gc_was_enabled:
            gc.enable()
    assert outcome.get("tokens") == fresh.generate("a different prompt", **OPTIONS).token_ids, outcome


def test_a_stream_without_a_tokenizer_is_refused_where_generate_gives_the_ids():
    """Without a tokenizer every text piece is "": the stream ran all its steps and yielded
    nothing, with no word of why, where generate() on the same ids returns the tokens."""
    model = toy_model(model_cls=LanguageModel)
    ids = model.tokenizer.encode("abc")
    model.tokenizer = None
    assert len(model.generate(ids, max_new_tokens=3).token_ids) == 3  # ids in, ids out: no tokenizer needed
    with pytest.raises(GenerationError, match="no tokenizer.*generate\\(ids\\).token_ids"):
        model.stream(ids, max_new_tokens=3)
