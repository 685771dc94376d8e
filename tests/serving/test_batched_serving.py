"""``lucidlm serve --parallel``: requests that wait together decode as one batch, and each answer
is still ``generate()``'s on that request alone.

A batch is forced the way it forms in production: the test holds the server's model lock while
the requests queue behind it (``waiting`` shows each one), then lets go; the first in line takes
the others along. ``server.batches`` (rows in a batch -> batches run) shows that they ran as one.
Requests that come while a batch runs join it (continuous batching): a streamed request read
event by event keeps its batch running while they come; ``server.joining.joined`` counts them.
The oracle is ``generate()`` on a second copy of the model, as in test_openai_server.py.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from typing import Any, Callable

import pytest

import lucidlm
from lucidlm.generation import generate
from lucidlm.serving import OpenAIServer
from serving_helpers import NAME, post, served


@pytest.fixture(scope="module")
def server():
    with served(lucidlm.load(), parallel=8) as server:
        yield server


@pytest.fixture(scope="module")
def oracle():
    return lucidlm.load()


def queued_behind_the_lock(server, calls: list[Callable[[], Any]]) -> list[Any]:
    """Run ``calls`` (each a request) while the test holds the model, each queued before the next
    starts; then let go and return their answers, in order."""
    answers: list[Any] = [None] * len(calls)

    def run(i: int) -> None:
        answers[i] = calls[i]()

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(calls))]
    with server.model_turn:
        for count, thread in enumerate(threads, 1):
            thread.start()
            wait_for(lambda: server.model_turn.waiting >= count, f"request {count} to queue")
    for thread in threads:
        thread.join(timeout=300)
    return answers


def wait_for(condition: Callable[[], bool], what: str, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"waited {seconds} s for {what}"
        time.sleep(0.002)


def streamed_text(chunks: list[dict], index: int = 0) -> tuple[str, str]:
    """(text, finish reason) of choice ``index`` of a streamed answer, chat or completion."""
    mine = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == index]
    text = "".join(c["delta"].get("content", "") if "delta" in c else c["text"] for c in mine)
    return text, mine[-1]["finish_reason"]


FINISH = {"eos": "stop", "stop": "stop", "length": "length"}


def test_waiting_requests_run_as_one_batch_and_each_answer_is_its_own(server, oracle):
    """Chat and completion, streamed and not, different prompts, max_tokens, stop strings and n:
    five rows in one batch, each answer what generate() gives that request alone."""
    cases = [  # (endpoint, body, generate's prompt and options)
        ("/v1/completions", {"prompt": "The capital of France is", "max_tokens": 12, "stop": [" Paris"]},
         dict(prompt="The capital of France is", max_new_tokens=12, stop=[" Paris"])),
        ("/v1/completions", {"prompt": "Once upon a time, in a small village,", "max_tokens": 20, "stream": True,
                             "n": 2},
         dict(prompt="Once upon a time, in a small village,", max_new_tokens=20)),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "What is 2+2?"}], "max_tokens": 16},
         dict(prompt="What is 2+2?", chat=True, max_new_tokens=16)),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Write a haiku about the sea."}],
                                  "max_tokens": 30, "stop": "\n", "stream": True},
         dict(prompt="Write a haiku about the sea.", chat=True, max_new_tokens=30, stop="\n")),
    ]
    before = server.batches.copy()
    answers = queued_behind_the_lock(server, [
        lambda path=path, body=body: post(server, path, {"model": NAME, "temperature": 0, **body})
        for path, body, _ in cases])
    assert server.batches - before == {5: 1}  # 1 + 2 (n=2) + 1 + 1 rows, one batch
    wants = [generate(oracle, temperature=0, **options) for _, _, options in cases]
    assert [w.finish_reason for w in wants] == ["stop", "length", "eos", "stop"]  # the ends this test means
    for (path, body, _), (status, answer), want in zip(cases, answers, wants):
        assert status == 200, answer
        n = body.get("n", 1)
        for index in range(n):
            if body.get("stream"):
                text, finish = streamed_text(answer, index)
            elif "messages" in body:
                text, finish = answer["choices"][index]["message"]["content"], answer["choices"][index]["finish_reason"]
            else:
                text, finish = answer["choices"][index]["text"], answer["choices"][index]["finish_reason"]
            assert (text, finish) == (want.text, FINISH[want.finish_reason]), path
        if not body.get("stream"):
            assert answer["usage"] == {"prompt_tokens": len(want.prompt_ids), "completion_tokens": len(want.token_ids),
                                       "total_tokens": len(want.prompt_ids) + len(want.token_ids)}


def test_seeded_sampling_and_logprobs_run_alone_and_the_greedy_ones_batch(server, oracle):
    """A seeded sampling request promises generate(seed=...)'s answer, and log-probs from a padded
    row would differ in the last digits: both run alone; the two greedy requests batch."""
    prompt = "My favourite food is"
    seeded = {"prompt": prompt, "max_tokens": 16, "temperature": 0.9, "seed": 7}
    scored = {"prompt": "The sky is", "max_tokens": 6, "temperature": 0, "logprobs": 2}
    greedy = [{"prompt": "Water boils at", "max_tokens": 10, "temperature": 0},
              {"prompt": "The first president of the United States was", "max_tokens": 8, "temperature": 0}]
    before = server.batches.copy()
    answers = queued_behind_the_lock(server, [lambda b=b: post(server, "/v1/completions", {"model": NAME, **b})
                                              for b in [seeded, greedy[0], scored, greedy[1]]])
    assert server.batches - before == {2: 1}  # the greedy pair only
    want = generate(oracle, prompt, max_new_tokens=16, temperature=0.9, seed=7)
    assert answers[0][1]["choices"][0]["text"] == want.text
    for body, (status, answer) in zip(greedy, [answers[1], answers[3]]):
        assert answer["choices"][0]["text"] == generate(oracle, body["prompt"], max_new_tokens=body["max_tokens"],
                                                        temperature=0).text
    alone = generate(oracle, "The sky is", max_new_tokens=6, temperature=0, logprobs=2)
    assert answers[2][1]["choices"][0]["logprobs"]["token_logprobs"] == alone.logprobs  # to the digit


def test_a_client_gone_mid_batch_leaves_the_others_answers_alone(server, oracle):
    """A streaming client that reads its first event and hangs up: its row ends, the batch goes
    on for the others, whose answers are generate()'s, and the model is free again after."""
    host, port = server.server_address[:2]
    leaving = {"model": NAME, "prompt": "1, 2, 3, 4, 5,", "max_tokens": 400, "temperature": 0, "stream": True}
    staying = [{"prompt": "The capital of France is", "max_tokens": 24},
               {"prompt": "def fibonacci(n):", "max_tokens": 30, "stream": True}]

    def hang_up() -> bytes:
        data = json.dumps(leaving).encode()
        with socket.create_connection((host, port), timeout=120) as connection:
            connection.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                               b"Content-Length: %d\r\n\r\n%b" % (len(data), data))
            first = connection.recv(4096)  # the headers, and perhaps the first event
        return first

    left_alone = generate(oracle, leaving["prompt"], max_new_tokens=400, temperature=0)
    assert left_alone.finish_reason == "length"  # not ended by EOS: only the hang-up can end it early
    before = server.batches.copy()
    started = time.perf_counter()
    answers = queued_behind_the_lock(server, [hang_up] + [
        lambda b=b: post(server, "/v1/completions", {"model": NAME, "temperature": 0, **b}) for b in staying])
    assert answers[0].startswith(b"HTTP/1.1 200 ")
    assert server.batches - before == {3: 1}
    for body, (status, answer) in zip(staying, answers[1:]):
        want = generate(oracle, body["prompt"], max_new_tokens=body["max_tokens"], temperature=0)
        text = streamed_text(answer)[0] if body.get("stream") else answer["choices"][0]["text"]
        assert (status, text) == (200, want.text)
    # the gone row ended: the model is passed on well before its 400 tokens (in a batch of 3, slower
    # than alone) would have been decoded
    assert post(server, "/v1/completions", {"model": NAME, "prompt": "Hi", "max_tokens": 2})[0] == 200
    assert time.perf_counter() - started < left_alone.seconds


def test_a_prompt_the_model_refuses_gets_its_400_before_it_waits(server):
    """Token ids past the vocabulary: refused while the model is busy (it never queues), and
    the requests that do queue batch without it."""
    with server.model_turn:
        status, answer = post(server, "/v1/completions", {"model": NAME, "prompt": [1, 10 ** 9], "temperature": 0})
    assert status == 400 and answer["error"]["param"] == "prompt"
    assert "outside this model's vocabulary" in answer["error"]["message"]


def test_parallel_must_be_a_whole_number_of_rows():
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match=f"parallel={bad!r} is invalid: use a whole number >= 1"):
            OpenAIServer(None, NAME, port=0, parallel=bad)


def test_a_chat_without_max_tokens_batches_beside_a_longer_prompt(server, oracle):
    """Most chat clients send no max_tokens (until the end of the context): such a request joins a
    batch whose longest prompt is another's, and its answer is still generate()'s alone."""
    question = "What is 2+2?"
    long_prompt = "Here is a long story about a small village by the sea, where the fishermen " * 3
    before = server.batches.copy()
    (chat_status, chat_answer), (status, answer) = queued_behind_the_lock(server, [
        lambda: post(server, "/v1/chat/completions", {"model": NAME, "temperature": 0,
                                                       "messages": [{"role": "user", "content": question}]}),
        lambda: post(server, "/v1/completions", {"model": NAME, "temperature": 0, "prompt": long_prompt,
                                                 "max_tokens": 8})])
    assert (chat_status, status) == (200, 200) and server.batches - before == {2: 1}
    want = generate(oracle, question, chat=True, temperature=0, max_new_tokens=oracle.config.max_seq_len)
    assert want.finish_reason == "eos"
    assert len(want.prompt_ids) < len(oracle.tokenizer.encode(long_prompt))  # the other prompt is the longest
    assert chat_answer["choices"][0]["message"]["content"] == want.text
    assert chat_answer["usage"]["completion_tokens"] == len(want.token_ids)
    assert answer["choices"][0]["text"] == generate(oracle, long_prompt, temperature=0, max_new_tokens=8).text


class Streamed:
    """A streamed request read event by event, so that the test acts while its batch runs."""

    def __init__(self, server, path: str, body: dict) -> None:
        host, port = server.server_address[:2]
        self.connection = http.client.HTTPConnection(host, port, timeout=120)
        self.connection.request("POST", path, json.dumps({"model": NAME, "stream": True, **body}),
                                {"Content-Type": "application/json"})
        self.response = self.connection.getresponse()
        assert self.response.status == 200
        self.events: list[dict] = []

    def read(self, count: int = 10 ** 9) -> list[dict]:
        """Read up to ``count`` more events (all of them by default); every event read so far."""
        for _ in range(count):
            line = self.response.readline()
            while line == b"\n":
                line = self.response.readline()
            if not line or line == b"data: [DONE]\n":
                break
            assert line.startswith(b"data: "), line
            self.events.append(json.loads(line[len(b"data: "):]))
        return self.events

    def close(self) -> None:
        self.connection.close()


def in_thread(call: Callable[[], Any]) -> Callable[[], Any]:
    """Start ``call`` in a thread; the returned function waits for its answer."""
    answer: list[Any] = []
    thread = threading.Thread(target=lambda: answer.append(call()), daemon=True)
    thread.start()

    def wait() -> Any:
        thread.join(timeout=300)
        assert answer, "no answer within 300 s"
        return answer[0]

    return wait


def test_requests_that_come_while_a_batch_runs_join_it_and_get_their_own_answers(server, oracle):
    """A streamed request runs alone; a completion with n=2 and a streamed chat come while it
    runs and join its batch (rows added, the chat's once the batch has run as far as its prompt
    is long); every answer is generate()'s alone."""
    story = "Once upon a time, in a small village,"
    joined = server.joining.joined
    running = Streamed(server, "/v1/completions", {"prompt": story, "max_tokens": 150, "temperature": 0})
    try:
        running.read(5)
        completion = in_thread(lambda: post(server, "/v1/completions", {
            "model": NAME, "prompt": "Water boils at", "max_tokens": 12, "temperature": 0, "n": 2, "stop": "."}))
        chat = in_thread(lambda: post(server, "/v1/chat/completions", {
            "model": NAME, "messages": [{"role": "user", "content": "What is 2+2?"}], "max_tokens": 20,
            "temperature": 0, "stream": True}))
        (status, answer), (chat_status, chat_events) = completion(), chat()
        assert len(running.read(1)) < 150, "the batch was still running when both were answered"
        events = running.read()
    finally:
        running.close()
    assert server.joining.joined - joined == 2
    want = generate(oracle, "Water boils at", max_new_tokens=12, temperature=0, stop=".")
    assert status == 200 and [c["text"] for c in answer["choices"]] == [want.text] * 2
    assert answer["usage"]["completion_tokens"] == 2 * len(want.token_ids)
    want_chat = generate(oracle, "What is 2+2?", chat=True, max_new_tokens=20, temperature=0)
    assert chat_status == 200 and streamed_text(chat_events) == (want_chat.text, FINISH[want_chat.finish_reason])
    assert len(want_chat.prompt_ids) > 5 + len(oracle.tokenizer.encode(story))  # it joined once the clock passed it
    want_story = generate(oracle, story, max_new_tokens=150, temperature=0)
    assert streamed_text(events) == (want_story.text, "length")


def queued_while_running(server, running: dict, bodies: list[dict]) -> tuple[list[dict], list[Any]]:
    """Stream ``running`` (a completion) and, while it runs, send ``bodies`` one by one, each
    queued for the model before the next is sent; (the running one's events, the others'
    answers)."""
    stream = Streamed(server, "/v1/completions", running)
    try:
        stream.read(3)
        waits = []
        for count, body in enumerate(bodies, 1):
            waits.append(in_thread(lambda body=body: post(server, "/v1/completions", {"model": NAME, **body})))
            wait_for(lambda: server.model_turn.waiting >= count, f"request {count} to queue")
        events = stream.read()
    finally:
        stream.close()
    return events, [wait() for wait in waits]


def test_no_request_joins_past_an_older_one_that_waits(server, oracle):
    """A seeded sampling request runs alone: it waits for the running batch to end, and a greedy
    request that comes after it waits behind it rather than joining the batch."""
    joined = server.joining.joined
    events, [(_, seeded_answer), (_, answer)] = queued_while_running(
        server, {"prompt": "1, 2, 3, 4, 5,", "max_tokens": 200, "temperature": 0},
        [{"prompt": "My favourite food is", "max_tokens": 8, "temperature": 0.9, "seed": 7},
         {"prompt": "Water boils at", "max_tokens": 6, "temperature": 0}])
    assert server.joining.joined == joined
    assert streamed_text(events)[0] == generate(oracle, "1, 2, 3, 4, 5,", max_new_tokens=200, temperature=0).text
    assert seeded_answer["choices"][0]["text"] == generate(oracle, "My favourite food is", max_new_tokens=8,
                                                           temperature=0.9, seed=7).text
    assert answer["choices"][0]["text"] == generate(oracle, "Water boils at", max_new_tokens=6, temperature=0).text


def test_without_cont_batching_a_request_waits_for_the_batch_under_way():
    model = lucidlm.load()
    with served(model, parallel=8, cont_batching=False) as server:
        assert server.joining is None
        events, [(status, answer)] = queued_while_running(
            server, {"prompt": "1, 2, 3, 4, 5,", "max_tokens": 60, "temperature": 0},
            [{"prompt": "Water boils at", "max_tokens": 6, "temperature": 0}])
    assert status == 200 and answer["choices"][0]["text"] == generate(model, "Water boils at", max_new_tokens=6,
                                                                      temperature=0).text
    assert streamed_text(events)[0] == generate(model, "1, 2, 3, 4, 5,", max_new_tokens=60, temperature=0).text
