"""The decode step is device-only and shape-stable: nothing in it reads a tensor back to
Python (a host sync on a GPU, a graph break under torch.compile), and a compiled step is
compiled once, not once per token."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import pytest
import torch
from generation_toys import byte_tokenizer, fresh_dynamo, one_torch_thread, toy_model  # noqa: F401 (autouse fixtures)
from torch._dynamo.testing import CompileCounter

from lucidlm import LanguageModel
from lucidlm.errors import GenerationError
from lucidlm.generation import generate
from lucidlm.generation.decode import DecodeSession
from lucidlm.generation.prompt_cache import CacheReuse
from lucidlm.peft import add_prefix

STEPS = 64
# Every way Python code turns a tensor into a Python value.
READ_BACKS = ("__int__", "__bool__", "__index__", "__float__", "item", "tolist")


@contextmanager
def reading_back_forbidden() -> Iterator[None]:
    saved = {name: getattr(torch.Tensor, name) for name in READ_BACKS}

    def refuse(name: str):
        def method(self, *args, **kwargs):
            raise AssertionError(f"Tensor.{name}() was called inside a decode step")
        return method

    try:
        for name in READ_BACKS:
            setattr(torch.Tensor, name, refuse(name))
        yield
    finally:
        for name, original in saved.items():
            setattr(torch.Tensor, name, original)


def test_the_guard_catches_a_read_back():
    """The patch is live: a tensor turned into a Python value inside it raises."""
    t = torch.tensor([3])
    for read in (int, bool, lambda x: x.item(), lambda x: x.tolist(), lambda x: [0, 1, 2, 3][x]):
        with reading_back_forbidden(), pytest.raises(AssertionError, match="inside a decode step"):
            read(t)
    assert int(t) == 3  # restored afterwards


def _prefixed(model):
    add_prefix(model, length=3, hidden=8)
    torch.nn.init.normal_(model.prefix_encoder.to_kv.weight)
    return model


@pytest.mark.parametrize("case", ["one row", "left-padded batch", "prefix", "hooks", "kept cache"])
def test_decode_steps_read_nothing_back(case):
    model = toy_model(seed=1, max_seq_len=128)
    rows = [[72, 105, 33]]
    reuse = CacheReuse() if case == "kept cache" else None
    if reuse is not None:  # a prompt cache kept from a generation that began the same (prompt_cache.py)
        generate(model, [72, 105], max_new_tokens=2, temperature=0, reuse_cache=True)
    if case == "left-padded batch":
        rows = [[72, 105, 33, 10, 65], [66, 67]]
    if case == "prefix":
        model = _prefixed(model)
    seen = []
    if case == "hooks":  # an inspection hook does not bring a read-back with it
        model.blocks[1].attn.hook_pattern.add_hook(lambda x, hook: seen.append(x.shape))
    L = max(len(r) for r in rows)
    tokens = []
    with DecodeSession(model, rows, capacity=L + STEPS, reuse=reuse) as session:
        next_ids = session.prefill().argmax(-1)
        with reading_back_forbidden():
            for _ in range(STEPS):
                tokens.append(next_ids)
                next_ids = session.step(next_ids).argmax(-1)  # argmax stays on the device
    assert session.next_slot == L + STEPS
    if reuse is not None:
        assert reuse.cached_tokens == 2
    if case == "hooks":
        assert seen[-1] == (1, 4, 1, L + STEPS)  # the pattern spans the whole static cache
    # The tokens are the ones greedy generation (checked against full recomputation in
    # test_generate_toy.py) produces, row by row.
    got = torch.stack(tokens, dim=1)  # (B, STEPS)
    for i, row in enumerate(rows):
        expected = generate(model, row, max_new_tokens=STEPS, temperature=0, stop_on_eos=False).token_ids
        assert got[i].tolist() == expected, (case, i)


@pytest.mark.parametrize("padded", [False, True])
def test_compiled_decode_step_compiles_once(padded):
    """64 steps, then a second generation of the same size: one graph, no recompile."""
    model = toy_model(seed=2, max_seq_len=512, model_cls=LanguageModel)
    eager = generate(model, [5, 6, 7], max_new_tokens=STEPS, temperature=0, stop_on_eos=False).token_ids
    counter = CompileCounter()  # a torch.compile backend that counts graphs and runs them eagerly
    model.compile(backend=counter, prefill=False)
    rows = [[5, 6, 7], [9, 8]] if padded else [[5, 6, 7]]
    for prompt_len_change in (0, 1):  # a second call with another prompt length, same cache bucket
        batch = [row + [11] * prompt_len_change for row in rows]
        with DecodeSession(model, batch, capacity=3 + prompt_len_change + STEPS) as session:
            next_ids = session.prefill().argmax(-1)
            for _ in range(STEPS):
                next_ids = session.step(next_ids).argmax(-1)
        assert counter.frame_count == 1, f"the decode step was compiled {counter.frame_count} times"
    assert counter.op_count > 0  # the graph holds the whole step
    compiled = generate(model, [5, 6, 7], max_new_tokens=STEPS, temperature=0, stop_on_eos=False).token_ids
    assert compiled == eager


def _steps_seen_per_token(model, rows, lookahead: bool, new_tokens: int = 12):
    """(tokens per step (B,) as lists, decode steps run when each token reached the caller)."""
    from lucidlm.generation.decode import sample_rows
    from lucidlm.generation.sampling import SamplingSettings

    calls = []
    # the prompt pass: one call, or one a row where their lengths differ (each prompt runs alone)
    prefill_calls = len(rows) if len({len(row) for row in rows}) > 1 else 1
    original = model.step
    model.step = lambda *args, **kwargs: calls.append(1) or original(*args, **kwargs)
    try:
        finished = torch.zeros(len(rows), dtype=torch.bool)
        tokens, steps_run = [], []
        for next_ids in sample_rows(model, rows, new_tokens, SamplingSettings(temperature=0.0), None, finished,
                                    lookahead=lookahead):
            steps_run.append(len(calls) - prefill_calls)
            tokens.append(next_ids.tolist())
    finally:
        del model.step
    return tokens, steps_run


@pytest.mark.parametrize("rows", [[[72, 105, 33]], [[72, 105, 33, 10, 65], [66, 67]]], ids=["one row", "padded batch"])
def test_lookahead_queues_the_next_step_before_the_caller_reads_a_token(rows):
    """With lookahead the step that feeds token t back is already queued when the caller gets
    token t (on a GPU its read-back then overlaps that step), the last token is never fed
    back, and the tokens are the ones of the plain loop."""
    model = toy_model(seed=3, max_seq_len=128)
    plain, plain_steps = _steps_seen_per_token(model, rows, lookahead=False)
    ahead, ahead_steps = _steps_seen_per_token(model, rows, lookahead=True)
    assert ahead == plain
    n = len(plain)
    assert plain_steps == list(range(n))
    assert ahead_steps == list(range(1, n)) + [n - 1]  # the last token: no step for it
    for i, row in enumerate(rows):  # and both are what greedy generation gives
        assert [t[i] for t in ahead] == generate(model, row, max_new_tokens=n, temperature=0,
                                                 stop_on_eos=False).token_ids


def test_generate_looks_ahead_and_stream_does_not(monkeypatch):
    """A stream's caller runs code between tokens (it may attach a hook that must reach the
    next step), so only generate, whose loop is lucidlm's own, queues a step early."""
    from lucidlm.generation import api, batch_run

    asked = []
    original = api.sample_rows
    for module in (api, batch_run):  # one prompt runs in api.py, a batch in batch_run.py
        monkeypatch.setattr(module, "sample_rows",
                            lambda *args, **kwargs: asked.append(kwargs.get("lookahead", False))
                            or original(*args, **kwargs))
    model = toy_model(seed=3, max_seq_len=128)
    generate(model, [72, 105], max_new_tokens=4, temperature=0)
    generate(model, [[72, 105], [33]], max_new_tokens=4, temperature=0)
    list(api.stream(model, [72, 105], max_new_tokens=4, temperature=0))
    assert asked == [True, True, False]


def test_a_session_refuses_steps_past_its_capacity_or_before_its_prompt():
    model = toy_model(seed=1, max_seq_len=128)
    with DecodeSession(model, [[72, 105, 33]], capacity=5) as session:
        with pytest.raises(GenerationError, match=r"before prefill\(\)"):
            session.step(torch.tensor([1]))
        next_ids = session.prefill().argmax(-1)
        for _ in range(2):  # slots 3 and 4
            next_ids = session.step(next_ids).argmax(-1)
        with pytest.raises(GenerationError, match="holds 5 tokens .prompt 3 . 2 fed back.; open the DecodeSession with a larger capacity"):
            session.step(next_ids)
        assert session.next_slot == 5


def test_token_readback_gives_each_step_its_own_host_row(monkeypatch):
    """On CUDA each step's ids go to their own row of pinned host memory, marked by an event
    recorded right after the copy; handing them out waits for that event. Here the CUDA parts
    are stood in for (a plain host buffer, an event that logs its calls)."""
    from lucidlm.generation.decode import TokenReadback

    calls = []

    class LoggedEvent:
        def record(self, stream):
            calls.append(("record", stream))

        def synchronize(self):
            calls.append("synchronize")

    # The event goes on the stream of the ids' own device (a model on cuda:1 while cuda:0 is current).
    monkeypatch.setattr(torch.cuda, "Event", LoggedEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: f"stream of {device}")
    readback = TokenReadback(torch.device("cpu"), batch_size=2, steps=3)
    assert readback.host is None  # on the host already: the ids pass through
    ids = torch.tensor([5, 6])
    assert readback.receive(*readback.send(0, ids)) is ids and calls == []
    readback.host = torch.full((3, 2), -1)  # the pinned buffer a CUDA model gets
    first, second = readback.send(0, torch.tensor([5, 6])), readback.send(1, torch.tensor([7, 8]))
    recorded = ("record", "stream of cpu")
    assert calls == [recorded, recorded]  # recorded at send time, nobody waited yet
    assert readback.receive(*second).tolist() == [7, 8] and readback.receive(*first).tolist() == [5, 6]
    assert calls == [recorded, recorded, "synchronize", "synchronize"]
    assert readback.host.tolist() == [[5, 6], [7, 8], [-1, -1]]
