"""``serving.model_worker``: the server's model work runs on the thread that serves.

Why it matters (the module's docstring): OpenMP pools in two threads cost a 2-core CPU ~3.7x of
its decoding speed. Here, a spy on the decode loop's model calls (``DecodeSession.prefill`` and
``step``) records the thread of every one, for a request alone, a streamed one, a batch, and the
prompt log-probs of echo; and the worker's own contract (results, errors, the end of a stream,
work after shutdown) is held to plain calls."""

from __future__ import annotations

import threading

import pytest
from serving_helpers import NAME, SERVING_THREAD, post, served
from test_batched_serving import queued_behind_the_lock

import lucidlm
from lucidlm.generation.decode import DecodeSession
from lucidlm.serving.model_worker import ModelWorker
from lucidlm.serving.row_feed import RowFeed


@pytest.fixture(scope="module")
def server():
    with served(lucidlm.load(), parallel=4) as server:
        yield server


@pytest.fixture
def model_threads(monkeypatch):
    """The names of the threads that ran each prefill, decode step and forward pass."""
    names: list[str] = []
    for method in ("prefill", "step"):
        original = getattr(DecodeSession, method)

        def spy(self, *args, _original=original, **kwargs):
            names.append(threading.current_thread().name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(DecodeSession, method, spy)
    return names


def test_every_generation_runs_on_the_serving_thread(server, model_threads):
    status, _ = post(server, "/v1/completions", {"model": NAME, "prompt": "Hello", "max_tokens": 4, "temperature": 0})
    assert status == 200 and len(model_threads) >= 2  # a prefill, then steps
    status, chunks = post(server, "/v1/chat/completions", {"model": NAME, "max_tokens": 4, "stream": True,
                                                           "messages": [{"role": "user", "content": "Hi"}]})
    assert status == 200 and chunks
    before = server.batches.copy()
    answers = queued_behind_the_lock(server, [
        lambda p=p: post(server, "/v1/completions", {"model": NAME, "prompt": p, "max_tokens": 3, "temperature": 0})
        for p in ("One", "Two", "Three")])
    assert [status for status, _ in answers] == [200] * 3 and server.batches - before == {3: 1}
    assert set(model_threads) == {SERVING_THREAD}


def test_prompt_log_probs_run_on_the_serving_thread(server, monkeypatch):
    from lucidlm.serving import openai_protocol

    names = []
    original = openai_protocol.prompt_logprobs

    def spy(*args, **kwargs):
        names.append(threading.current_thread().name)
        return original(*args, **kwargs)

    monkeypatch.setattr(openai_protocol, "prompt_logprobs", spy)
    status, _ = post(server, "/v1/completions", {"model": NAME, "prompt": "Hello there", "max_tokens": 0,
                                                 "echo": True, "logprobs": 1})
    assert status == 200 and names == [SERVING_THREAD]


@pytest.fixture
def worker():
    worker = ModelWorker()
    stop = threading.Event()
    thread = threading.Thread(target=worker.run, args=(lambda: not stop.is_set(),), kwargs={"poll_interval": 0.01},
                              name="the-worker", daemon=True)
    thread.start()
    yield worker
    stop.set()
    thread.join(timeout=10)


def test_calls_run_on_the_worker_and_return_or_raise_what_they_did(worker):
    assert worker.call(lambda: threading.current_thread().name) == "the-worker"
    assert worker.call(lambda a, b: a + b, 2, 3) == 5
    with pytest.raises(ZeroDivisionError):
        worker.call(lambda: 1 / 0)
    # called from the worker itself: run there and then (a queued call would wait for itself)
    assert worker.call(lambda: worker.call(lambda: threading.current_thread().name)) == "the-worker"


def test_a_stream_steps_on_the_worker_and_ends(worker):
    class Pieces:
        result = None

        def __init__(self):
            self.threads, self.closed = [], None

        def __iter__(self):
            return self

        def __next__(self):
            self.threads.append(threading.current_thread().name)
            if len(self.threads) > 3:
                self.result = "done"
                raise StopIteration
            return str(len(self.threads))

        def close(self):
            self.closed = threading.current_thread().name

    pieces = Pieces()
    stream = worker.stream(pieces)
    assert list(stream) == ["1", "2", "3"] and stream.result == "done"
    stream.close()
    assert set(pieces.threads) == {"the-worker"} and pieces.closed == "the-worker"


def test_work_after_the_loop_ends_is_refused_not_left_waiting():
    worker = ModelWorker()
    worker.run(keep_going=lambda: False)  # ends at once
    with pytest.raises(RuntimeError, match="the server is shutting down"):
        worker.call(lambda: 1)


def test_a_batch_the_worker_never_runs_fails_its_rows_and_lets_go_of_the_model():
    """The server shut down with a batch still queued (or before it could be queued): its rows
    raise the shutdown at their reader's next piece and the model is let go, so no request thread
    waits for ever on a row no one will feed, nor on the model."""
    from lucidlm.serving.batching import BatchMember, start_batch

    def members():
        leader = BatchMember(None, [[1, 2]], {"max_new_tokens": 3}, None)
        rider = BatchMember(None, [[3], [4]], {"max_new_tokens": 3}, None)
        rider.feeds = [RowFeed(), RowFeed()]  # as joiner gives a rider taken along
        return [leader, rider]

    queued = ModelWorker()
    ends: list[str] = []
    batch = members()
    start_batch(None, batch, lambda: ends.append("queued"), queued)
    queued.run(keep_going=lambda: False)  # shut down before the queued batch ran
    stopped = members()
    start_batch(None, stopped, lambda: ends.append("refused"), queued)  # shut down already
    assert ends == ["queued", "refused"]
    for feed in [feed for member in batch + stopped for feed in member.feeds]:
        with pytest.raises(RuntimeError, match="the server is shutting down"):
            next(feed)


def test_work_queued_while_the_loop_ends_is_refused_not_left_waiting():
    """submit checked that the loop still ran, then the loop ended (and failed what was queued)
    before submit's put: that work must still fail, not wait for ever."""
    worker = ModelWorker()
    in_put, go_on = threading.Event(), threading.Event()
    tasks = worker._tasks

    class SlowPut:  # the queue, with submit's put held between its check and the put
        get, get_nowait = tasks.get, tasks.get_nowait

        def put(self, item):
            in_put.set()
            go_on.wait(5)
            tasks.put(item)

    worker._tasks = SlowPut()
    futures = []
    submitter = threading.Thread(target=lambda: futures.append(worker.submit(lambda: 1)), daemon=True)
    submitter.start()
    assert in_put.wait(5)
    loop = threading.Thread(target=worker.run, args=(lambda: False,), daemon=True)
    loop.start()
    loop.join(0.3)
    go_on.set()
    submitter.join(5)
    loop.join(5)
    with pytest.raises(RuntimeError, match="the server is shutting down"):
        futures[0].result(timeout=2)
