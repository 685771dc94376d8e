"""Prompt caching across chat turns (generation/prompt_cache.py): a turn reuses the KV cache
of the last one for the ids they share and runs only the rest, and gives exactly what a fresh
prefill of the whole prompt gives; whatever could have changed the kept values makes it run
the whole prompt again."""

from __future__ import annotations

import pytest
import torch
from generation_toys import first_token_logits, toy_model
from torch._dynamo.testing import CompileCounter

from lucidlm import LanguageModel
from lucidlm.chat import Conversation, encode_chat
from lucidlm.errors import GenerationError
from lucidlm.generation import generate, stream
from lucidlm.peft.lora import add_lora

pytestmark = pytest.mark.usefixtures("one_thread")

QUESTIONS = ["Hi there!", "What is 2+2?", "And 3+3?", "Name a colour.", "Thanks, bye."]
NEW = 12


def _conversation(model, reuse: bool, questions=QUESTIONS, system=None, **options):
    """Each turn's (answer ids, cached prompt tokens), greedy."""
    convo, turns = Conversation(system=system), []
    for question in questions:
        convo.add_user(question)
        "".join(convo.reply(model, temperature=0, max_new_tokens=NEW, reuse_cache=reuse, **options))
        turns.append((convo.last_result.token_ids, convo.last_result.cached_tokens))
    return turns


def _turn(model, prompt, reuse=True):
    return generate(model, prompt, max_new_tokens=NEW, temperature=0, stop_on_eos=False, reuse_cache=reuse)


def _next_prompt(prompt, result, more=(32, 65, 66, 67)):
    return list(prompt) + result.token_ids + list(more)


def test_a_conversation_gives_the_same_tokens_with_and_without_reuse():
    model = toy_model(seed=3, max_seq_len=512)
    fresh = _conversation(model, reuse=False)
    reused = _conversation(model, reuse=True)
    assert [ids for ids, _ in reused] == [ids for ids, _ in fresh]
    assert reused[0][1] == 0 and all(cached > 0 for _, cached in reused[1:])  # later turns ran only what is new
    assert all(cached == 0 for _, cached in fresh)


def test_the_chat_reuses_by_default_and_runs_only_the_new_message():
    model = toy_model(seed=3, max_seq_len=512)
    convo = Conversation()
    convo.add_user(QUESTIONS[0])
    "".join(convo.reply(model, temperature=0, max_new_tokens=NEW))
    first = convo.last_result
    convo.add_user(QUESTIONS[1])
    ids = encode_chat(model.tokenizer, convo.messages)
    "".join(convo.reply(model, temperature=0, max_new_tokens=NEW))
    fed = first.prompt_ids + first.token_ids[:-1]  # the last sampled token was never fed
    shared = next(i for i, (a, b) in enumerate(zip(fed + [-1], ids)) if a != b)
    assert convo.last_result.cached_tokens == shared > len(first.prompt_ids)


def test_the_first_new_token_logits_match_a_fresh_prefill():
    model = toy_model(seed=4, max_seq_len=256)
    prompt = [72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100]
    first = _turn(model, prompt, reuse=False)
    reused, fresh, cached = first_token_logits(model, prompt, first.token_ids, _next_prompt(prompt, first))
    assert cached == len(prompt) + NEW - 1
    torch.testing.assert_close(reused, fresh, rtol=1e-5, atol=1e-5)
    assert reused.argmax() == fresh.argmax()


def test_the_same_prompt_again_runs_its_last_token_only():
    model = toy_model(seed=5)
    prompt = list(b"Once upon a time")
    _turn(model, prompt)
    again = _turn(model, prompt)
    assert again.cached_tokens == len(prompt) - 1
    assert again.token_ids == _turn(model, prompt, reuse=False).token_ids


def _two_turns(model, between):
    """Turn 1 with reuse, ``between(model)``, turn 2 with reuse: (turn 2, its prompt)."""
    prompt = list(b"The cat sat on")
    first = _turn(model, prompt)
    assert model.kept_kv_cache is not None
    between(model)
    second_prompt = _next_prompt(prompt, first)
    return _turn(model, second_prompt), second_prompt


def test_a_weight_changed_in_place_runs_the_whole_prompt():
    model = toy_model(seed=6)

    def edit(m):
        with torch.no_grad():
            m.blocks[0].attn.v_proj.weight.mul_(3.0)
    second, prompt = _two_turns(model, edit)
    assert second.cached_tokens == 0
    assert second.token_ids == _turn(model, prompt, reuse=False).token_ids


def test_a_hook_added_between_turns_sees_the_whole_prompt():
    model = toy_model(seed=7)
    shapes = []
    second, prompt = _two_turns(model, lambda m: m.hook_embed.add_hook(lambda x, hook: shapes.append(x.shape)))
    assert second.cached_tokens == 0 and shapes[0][1] == len(prompt)
    model.reset_hooks()
    assert second.token_ids == _turn(model, prompt, reuse=False).token_ids


def test_a_torch_hook_during_the_kept_run_keeps_nothing():
    model = toy_model(seed=7)
    handle = model.blocks[1].register_forward_hook(lambda module, args, out: out * 1.5)
    prompt = list(b"The cat sat on")
    first = _turn(model, prompt)
    assert model.kept_kv_cache is None  # a hook ran in its passes: its values are not the model's
    handle.remove()
    second = _turn(model, _next_prompt(prompt, first))
    assert second.cached_tokens == 0
    assert second.token_ids == _turn(model, _next_prompt(prompt, first), reuse=False).token_ids


def test_a_lora_attached_between_turns_runs_the_whole_prompt():
    model = toy_model(seed=8)

    def attach(m):
        add_lora(m, r=4, targets=["q", "v"])
        with torch.no_grad():
            for name, p in m.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.5)
    second, prompt = _two_turns(model, attach)
    assert second.cached_tokens == 0
    assert second.token_ids == _turn(model, prompt, reuse=False).token_ids


def test_another_generation_in_between_runs_the_whole_prompt():
    model = toy_model(seed=9)
    second, prompt = _two_turns(model, lambda m: generate(m, [1, 2, 3], max_new_tokens=3, temperature=0))
    assert second.cached_tokens == 0
    assert second.token_ids == _turn(model, prompt, reuse=False).token_ids


def test_a_beam_search_in_between_runs_the_whole_prompt():
    model = toy_model(seed=9)
    second, prompt = _two_turns(model, lambda m: generate(m, [1, 2, 3], max_new_tokens=3, num_beams=2,
                                                          reuse_cache=True))
    assert second.cached_tokens == 0
    assert second.token_ids == _turn(model, prompt, reuse=False).token_ids


def test_a_stream_stopped_part_way_keeps_nothing():
    """Ctrl-C while an answer streams: the caller stops reading before the end."""
    model = toy_model(seed=10)
    prompt = list(b"Tell me a story")
    _turn(model, prompt)
    pieces = stream(model, prompt + [32], max_new_tokens=NEW, temperature=0, stop_on_eos=False, reuse_cache=True)
    next(pieces), next(pieces)
    pieces.close()
    assert model.kept_kv_cache is None
    again = _turn(model, prompt + [32, 33])
    assert again.cached_tokens == 0


def test_an_interrupted_decode_step_keeps_nothing(monkeypatch):
    model = toy_model(seed=10)
    prompt = list(b"Tell me a story")
    _turn(model, prompt)
    calls = []
    step = model.step

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return step(*args, **kwargs)
    monkeypatch.setattr(model, "step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _turn(model, prompt + [32])
    monkeypatch.undo()
    assert model.kept_kv_cache is None
    assert _turn(model, prompt + [32, 33]).cached_tokens == 0


def test_a_different_system_prompt_reuses_only_what_is_shared():
    model = toy_model(seed=11, max_seq_len=512)
    convo = Conversation(system="Be brief.")
    convo.add_user(QUESTIONS[0])
    "".join(convo.reply(model, temperature=0, max_new_tokens=NEW))
    first = convo.last_result
    convo.system = "Be verbose."
    convo.add_user(QUESTIONS[1])
    ids = encode_chat(model.tokenizer, convo.messages)
    answer = "".join(convo.reply(model, temperature=0, max_new_tokens=NEW))
    fed = first.prompt_ids + first.token_ids[:-1]
    shared = next(i for i, (a, b) in enumerate(zip(fed, ids)) if a != b)
    assert convo.last_result.cached_tokens == shared < len(first.prompt_ids)
    fresh = generate(model, ids, temperature=0, max_new_tokens=NEW)
    assert convo.last_result.token_ids == fresh.token_ids and answer == fresh.text


def test_dropping_the_oldest_turns_for_the_context_stays_exact():
    model = toy_model(seed=12, max_seq_len=160)
    convo = Conversation(system="S")
    for question in QUESTIONS:
        convo.add_user(question)
        convo.fit_context(model, NEW)
        ids = encode_chat(model.tokenizer, convo.messages)
        "".join(convo.reply(model, temperature=0, max_new_tokens=NEW))
        assert convo.last_result.token_ids == generate(model, ids, temperature=0, max_new_tokens=NEW).token_ids
    assert convo.history[0]["content"] != QUESTIONS[0]  # the oldest turns were dropped on the way


def test_reuse_cache_is_checked_and_one_prompt_at_a_time():
    model = toy_model(seed=1)
    with pytest.raises(GenerationError, match="reuse_cache must be True or False"):
        generate(model, [1, 2], reuse_cache="yes")
    with pytest.raises(GenerationError, match="one prompt at a time"):
        generate(model, [[1, 2], [3, 4]], reuse_cache=True)


def test_a_batch_of_one_row_reuses_the_cache_as_one_prompt():
    """A (1, T) tensor, as transformers users pass one prompt: cached like a list of ids, and
    still answered as a batch is (a list of one result)."""
    model = toy_model(seed=7)
    prompt = list(b"The cat sat on")

    def row_turn(ids):
        results = generate(model, torch.tensor([ids]), max_new_tokens=NEW, temperature=0, stop_on_eos=False,
                           reuse_cache=True)
        assert isinstance(results, list) and len(results) == 1
        return results[0]

    first = row_turn(prompt)
    second_prompt = _next_prompt(prompt, first)
    second = row_turn(second_prompt)
    assert second.cached_tokens == len(prompt) + NEW - 1  # all the first turn kept (its last token never fed)
    assert first.token_ids == _turn(model, prompt, reuse=False).token_ids
    assert second.token_ids == _turn(model, second_prompt, reuse=False).token_ids


def test_a_compiled_model_reuses_its_cache_too():
    """Without a second compile: the rest of a prompt after kept slots runs eagerly."""
    counter = CompileCounter()  # a torch.compile backend that counts graphs and runs them eagerly
    model = toy_model(seed=13, model_cls=LanguageModel).compile(backend=counter)
    prompt = list(b"The cat sat on")
    first = _turn(model, prompt)
    graphs = counter.frame_count
    second = _turn(model, _next_prompt(prompt, first))
    assert second.cached_tokens == len(prompt) + NEW - 1
    assert counter.frame_count == graphs
    assert second.token_ids == _turn(toy_model(seed=13), _next_prompt(prompt, first), reuse=False).token_ids


def test_chat_stats_count_what_the_prompt_pass_ran():
    from lucidlm.commands.chat import _stats
    from lucidlm.generation.api import GenerationResult

    result = GenerationResult([1, 2, 3], "abc", list(range(120)), "eos", cached_tokens=100)
    line = _stats(result, start=0.0, first=0.5, end=1.5)
    assert "prompt 120 tokens (100 reused from the last turn's cache) read in 0.50 s, 40 tok/s" in line


def test_a_copy_of_the_model_carries_no_kept_cache():
    import copy
    model = toy_model(seed=14)
    prompt = list(b"The cat sat on")
    first = _turn(model, prompt)
    twin = copy.deepcopy(model)
    assert model.kept_kv_cache is not None and twin.kept_kv_cache is None
    assert _turn(twin, _next_prompt(prompt, first)).cached_tokens == 0
    assert _turn(model, _next_prompt(prompt, first)).cached_tokens == len(prompt) + NEW - 1
