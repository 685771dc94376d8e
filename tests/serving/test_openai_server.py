"""``lucidlm serve``'s OpenAI API, driven by the official ``openai`` client.

Two oracles: the openai package's own response models, which every response and stream chunk
must validate against strictly (the client itself builds them leniently, so a malformed answer
would slip through it), and lucidlm's ``generate()`` (tested against Hugging Face elsewhere)
on a second copy of the same model, for the text, token counts, finish reasons and log-probs.
The server runs in a thread of this process, on a free port, with the embedded model as
``lucidlm.load()`` gives it (what ``lucidlm serve`` serves by default).
"""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request
from http.client import HTTPConnection

import openai
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

import lucidlm
from lucidlm.generation import generate
from lucidlm.generation.chat_template import encode_chat
from lucidlm.generation.prompt_logprobs import prompt_logprobs
from lucidlm.serving import OpenAIServer
from serving_helpers import NAME, served

PROMPT = "The capital of France is"
QUESTION = "What is 2+2?"


@pytest.fixture(scope="module")
def server():
    with served(lucidlm.load()) as server:
        yield server


@pytest.fixture(scope="module")
def oracle():
    """Another copy of the served model, for generate(): never the server's own, whose KV
    cache a request may be using."""
    return lucidlm.load()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=120)


def completion(client, **request) -> Completion:
    raw = client.completions.with_raw_response.create(model=NAME, **request)
    return Completion.model_validate(raw.http_response.json())  # strict: types, literals, required fields


def chat(client, **request) -> ChatCompletion:
    raw = client.chat.completions.with_raw_response.create(model=NAME, **request)
    return ChatCompletion.model_validate(raw.http_response.json())


def streamed(client, endpoint: str, **request) -> list:
    """The chunks of a streamed answer, each validated strictly against the client's chunk model."""
    if endpoint == "chat":
        return [ChatCompletionChunk.model_validate(chunk.to_dict())
                for chunk in client.chat.completions.create(model=NAME, stream=True, **request)]
    return [completion_chunk(chunk.to_dict()) for chunk in client.completions.create(model=NAME, stream=True,
                                                                                      **request)]


def completion_chunk(data: dict) -> Completion:
    """The client types a streamed completion chunk as a Completion, whose finish_reason is
    required; OpenAI's own streams send null there until a choice ends, so null is let through
    (and nothing else: a value must be one of the model's)."""
    choices = [dict(c, finish_reason=c["finish_reason"] or "stop") for c in data["choices"]]
    checked = Completion.model_validate(dict(data, choices=choices))
    for choice, sent in zip(checked.choices, data["choices"]):
        choice.finish_reason = sent["finish_reason"]
    return checked


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def http(server, path: str, method: str = "GET", data: bytes | None = None) -> tuple[int, dict, dict]:
    """(status, JSON body, headers) of a plain HTTP request, error statuses included."""
    host, port = server.server_address[:2]
    request = urllib.request.Request(f"http://{host}:{port}{path}", data=data, method=method,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read()), dict(response.headers)
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read()), dict(error.headers)


# ---------------------------------------------------------------------------------- models, health

def test_the_paths_without_v1_answer_as_llama_server_does(server, oracle):
    """A client given the base URL without /v1 (llama-server answers /completions,
    /chat/completions and /models too): the same answers as under /v1."""
    base_url = server.url.removesuffix("/v1")
    bare = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)
    assert [m.id for m in bare.models.list().data] == [NAME]
    assert bare.models.retrieve(NAME).id == NAME
    want = generate(oracle, PROMPT, temperature=0, max_new_tokens=8)
    assert bare.completions.create(model=NAME, prompt=PROMPT, temperature=0, max_tokens=8).choices[0].text == want.text
    chat_want = generate(oracle, QUESTION, chat=True, temperature=0, max_new_tokens=8)
    answer = bare.chat.completions.create(model=NAME, messages=user(QUESTION), temperature=0, max_tokens=8)
    assert answer.choices[0].message.content == chat_want.text
    assert http(server, "/v2/models")[0] == 404


def test_models_lists_the_one_served_model(client, server):
    assert [m.id for m in client.models.list().data] == [NAME]
    assert client.models.retrieve(NAME).id == NAME
    with pytest.raises(openai.NotFoundError, match="model 'gpt-4' is not served here"):
        client.models.retrieve("gpt-4")
    assert http(server, "/health")[:2] == (200, {"status": "ok"})


# ---------------------------------------------------------------------------------- completions

def test_greedy_completion_is_generate(client, oracle):
    want = generate(oracle, PROMPT, max_new_tokens=12, temperature=0)
    got = completion(client, prompt=PROMPT, max_tokens=12, temperature=0)
    assert got.choices[0].text == want.text
    assert got.choices[0].finish_reason == "length" and want.finish_reason == "length"
    assert (got.usage.prompt_tokens, got.usage.completion_tokens, got.usage.total_tokens) == \
        (len(want.prompt_ids), len(want.token_ids), len(want.prompt_ids) + len(want.token_ids))
    assert got.id.startswith("cmpl-") and got.object == "text_completion" and got.model == NAME


def test_left_out_options_are_the_model_defaults_and_max_tokens_16(client, oracle):
    """No temperature, top_p or max_tokens: the model's sampling defaults (as generate's), 16 tokens."""
    want = generate(oracle, "Once upon a time", max_new_tokens=16, seed=3)
    got = completion(client, prompt="Once upon a time", seed=3)
    assert len(want.token_ids) == 16 and got.usage.completion_tokens == 16
    assert got.choices[0].text == want.text


def test_token_ids_and_a_list_of_prompts(client, oracle):
    ids = oracle.tokenizer.encode(PROMPT)
    by_ids = completion(client, prompt=ids, max_tokens=6, temperature=0)
    assert by_ids.choices[0].text == generate(oracle, PROMPT, max_new_tokens=6, temperature=0).text
    prompts = [PROMPT, "Once upon a time"]
    many = completion(client, prompt=prompts, max_tokens=5, temperature=0)
    wants = [generate(oracle, p, max_new_tokens=5, temperature=0) for p in prompts]
    assert [c.index for c in many.choices] == [0, 1]
    assert [c.text for c in many.choices] == [w.text for w in wants]
    assert many.usage.prompt_tokens == sum(len(w.prompt_ids) for w in wants)


def test_echo_puts_the_prompt_first(client, oracle):
    want = PROMPT + generate(oracle, PROMPT, max_new_tokens=4, temperature=0).text
    assert completion(client, prompt=PROMPT, max_tokens=4, temperature=0, echo=True).choices[0].text == want
    chunks = streamed(client, "completions", prompt=PROMPT, max_tokens=4, temperature=0, echo=True)
    assert chunks[0].choices[0].text == PROMPT and "".join(c.choices[0].text for c in chunks) == want


def test_echo_with_logprobs_scores_the_prompt_first(server, client, oracle):
    """OpenAI's (and vLLM's) prompt log-probs, as evaluation harnesses ask for them: the prompt's
    tokens, the first with null (no context), then the answer's, offsets counted in the whole
    text; the values are prompt_logprobs' and generate's on a second copy of the model."""
    want = generate(oracle, PROMPT, max_new_tokens=3, temperature=0, logprobs=2)
    scores = prompt_logprobs(oracle, PROMPT, top=2)
    body = http(server, "/v1/completions", "POST", json.dumps(dict(model=NAME, prompt=PROMPT, max_tokens=3,
                                                                    temperature=0, echo=True, logprobs=2)).encode())[1]
    choice = body["choices"][0]
    logprobs = choice["logprobs"]
    decode = oracle.tokenizer.decode
    ids = scores.token_ids + want.token_ids
    assert choice["text"] == PROMPT + want.text == decode(ids)
    assert logprobs["tokens"] == [decode([t]) for t in ids]
    assert logprobs["text_offset"] == [len(decode(ids[:i])) for i in range(len(ids))]
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert logprobs["token_logprobs"][1:] == pytest.approx(scores.logprobs[1:] + want.logprobs, abs=1e-6)
    for top, step in zip(logprobs["top_logprobs"][1:], scores.top_logprobs[1:] + want.top_logprobs):
        assert top == pytest.approx({decode([token]): value for token, value in step}, abs=1e-6)
    # max_tokens 0: the prompt alone, scored (what a harness sends to score a given answer)
    scored = http(server, "/v1/completions", "POST", json.dumps(dict(model=NAME, prompt=scores.token_ids, max_tokens=0,
                                                                      echo=True, logprobs=0)).encode())[1]
    only = scored["choices"][0]["logprobs"]
    assert scored["choices"][0]["text"] == PROMPT and only["top_logprobs"] is None  # logprobs 0: no alternatives
    assert only["token_logprobs"][1:] == pytest.approx(scores.logprobs[1:], abs=1e-6)
    # streamed: the echoed prompt's chunk carries its log-probs, the closing chunk the answer's
    chunks = [json.loads(line[6:]) for line in raw_stream(server, dict(model=NAME, prompt=PROMPT, max_tokens=3,
                                                                        temperature=0, echo=True, logprobs=2))]
    first, last = chunks[0]["choices"][0], chunks[-1]["choices"][0]
    assert first["text"] == PROMPT and first["logprobs"]["tokens"] == logprobs["tokens"][:len(scores.token_ids)]
    assert first["logprobs"]["token_logprobs"] == logprobs["token_logprobs"][:len(scores.token_ids)]
    assert last["logprobs"]["text_offset"] == logprobs["text_offset"][len(scores.token_ids):]
    assert last["logprobs"]["token_logprobs"] == logprobs["token_logprobs"][len(scores.token_ids):]


def raw_stream(server, request: dict) -> list[str]:
    """The ``data: {...}`` lines of a streamed answer, as sent (before [DONE])."""
    host, port = server.server_address[:2]
    connection = HTTPConnection(host, port, timeout=60)
    connection.request("POST", "/v1/completions", json.dumps(dict(request, stream=True)),
                       {"Content-Type": "application/json"})
    lines = [line for line in connection.getresponse().read().decode().splitlines() if line.startswith("data: ")]
    connection.close()
    assert lines[-1] == "data: [DONE]"
    return lines[:-1]


def test_stop_and_max_tokens_end_where_generate_ends(client, oracle):
    full = generate(oracle, PROMPT, max_new_tokens=20, temperature=0).text
    stop = full.split()[2]  # a word the greedy answer writes
    want = generate(oracle, PROMPT, max_new_tokens=20, temperature=0, stop=[stop, "zzz"])
    got = completion(client, prompt=PROMPT, max_tokens=20, temperature=0, stop=[stop, "zzz"])
    assert want.finish_reason == "stop" and got.choices[0].finish_reason == "stop"
    assert got.choices[0].text == want.text == full[:full.index(stop)]
    short = completion(client, prompt=PROMPT, max_tokens=3, temperature=0)
    assert short.choices[0].finish_reason == "length" and short.usage.completion_tokens == 3
    assert short.choices[0].text == generate(oracle, PROMPT, max_new_tokens=3, temperature=0).text


def test_completion_logprobs_are_generates(client, oracle):
    want = generate(oracle, PROMPT, max_new_tokens=6, temperature=0, logprobs=3)
    got = completion(client, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3).choices[0].logprobs
    decode = oracle.tokenizer.decode
    assert got.tokens == [decode([t]) for t in want.token_ids]
    assert got.token_logprobs == pytest.approx(want.logprobs, abs=1e-6)
    assert got.text_offset == [len(decode(want.token_ids[:i])) for i in range(len(want.token_ids))]
    assert len(got.top_logprobs) == 6
    for top, step in zip(got.top_logprobs, want.top_logprobs):
        assert top == pytest.approx({decode([token]): value for token, value in step}, abs=1e-6)


def test_seed_reproduces_and_n_choices_take_seed_plus_j(client, oracle):
    """n=2 samples twice, choice j with seed + j: each choice is generate() with that seed."""
    request = dict(prompt=PROMPT, max_tokens=10, temperature=1.0, top_p=1.0)
    wants = [generate(oracle, PROMPT, max_new_tokens=10, temperature=1.0, top_p=1.0, seed=s).text for s in (41, 42)]
    got = completion(client, n=2, seed=41, **request)
    assert [c.text for c in got.choices] == wants
    assert [c.index for c in got.choices] == [0, 1]
    assert completion(client, seed=42, **request).choices[0].text == wants[1]
    assert got.usage.prompt_tokens == len(oracle.tokenizer.encode(PROMPT))  # the prompt counts once
    greedy = completion(client, prompt=PROMPT, max_tokens=5, temperature=0, n=2)
    assert greedy.choices[0].text == greedy.choices[1].text


def test_logit_bias_forces_a_token(client, oracle):
    [paris] = oracle.tokenizer.encode(" Paris")
    got = completion(client, prompt="Hello", max_tokens=4, temperature=0, logit_bias={str(paris): 100})
    assert got.choices[0].text == " Paris" * 4
    assert got.choices[0].text == generate(oracle, "Hello", max_new_tokens=4, temperature=0,
                                           logit_bias={paris: 100}).text


def test_streamed_completion_joins_to_the_answer(client, oracle):
    want = generate(oracle, PROMPT, max_new_tokens=12, temperature=0)
    chunks = streamed(client, "completions", prompt=PROMPT, max_tokens=12, temperature=0,
                      stream_options={"include_usage": True})
    *answer, usage = chunks
    assert "".join(c.choices[0].text for c in answer) == want.text
    assert [c.choices[0].finish_reason for c in answer] == [None] * (len(answer) - 1) + ["length"]
    assert usage.choices == [] and (usage.usage.prompt_tokens, usage.usage.completion_tokens) == \
        (len(want.prompt_ids), len(want.token_ids))
    assert len({c.id for c in chunks}) == 1


def test_a_stream_to_an_http_1_0_client_is_not_chunked(server, oracle):
    """HTTP/1.0 (nginx's proxy_pass by default) has no chunked bodies: the events come as they
    are and the connection's end ends them, as the HTTP spec requires."""
    body = json.dumps({"model": NAME, "prompt": PROMPT, "max_tokens": 5, "temperature": 0, "stream": True}).encode()
    with socket.create_connection(server.server_address[:2], timeout=60) as connection:
        connection.sendall(b"POST /v1/completions HTTP/1.0\r\nContent-Type: application/json\r\n"
                           b"Content-Length: %d\r\n\r\n%b" % (len(body), body))
        received = b""
        while data := connection.recv(65536):
            received += data
    head, events = received.split(b"\r\n\r\n", 1)
    headers = dict(line.split(": ", 1) for line in head.decode().split("\r\n")[1:])
    assert head.startswith(b"HTTP/1.1 200 ") and "Transfer-Encoding" not in headers
    assert headers["Connection"] == "close" and headers["Content-Type"] == "text/event-stream"
    *chunks, done = events.decode().split("\n\n")[:-1]
    assert done == "data: [DONE]" and all(chunk.startswith("data: {") for chunk in chunks)
    text = "".join(completion_chunk(json.loads(chunk[len("data: "):])).choices[0].text for chunk in chunks)
    assert text == generate(oracle, PROMPT, max_new_tokens=5, temperature=0).text


# ---------------------------------------------------------------------------------- chat

def test_chat_is_generate_with_the_chat_template(client, oracle):
    """No max_tokens: the answer runs to the model's end of turn (finish_reason "stop")."""
    want = generate(oracle, QUESTION, chat=True, temperature=0, max_new_tokens=oracle.config.max_seq_len)
    got = chat(client, messages=user(QUESTION), temperature=0)
    assert want.finish_reason == "eos" and got.choices[0].finish_reason == "stop"
    assert got.choices[0].message.content == want.text and got.choices[0].message.role == "assistant"
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (len(want.prompt_ids), len(want.token_ids))
    assert got.id.startswith("chatcmpl-") and got.object == "chat.completion"
    capped = chat(client, messages=user(QUESTION), temperature=0, max_completion_tokens=3)
    assert capped.choices[0].finish_reason == "length"
    assert capped.choices[0].message.content == generate(oracle, QUESTION, chat=True, temperature=0,
                                                         max_new_tokens=3).text


def test_multi_turn_messages_render_as_the_chat_template(client, oracle):
    """developer is system to the template; a content of text parts is their texts joined."""
    sent = [{"role": "developer", "content": "Answer in one word."},
            {"role": "user", "content": [{"type": "text", "text": "Capital of "}, {"type": "text", "text": "Italy?"}]},
            {"role": "assistant", "content": "Rome."},
            {"role": "user", "content": "And of France?"}]
    rendered = [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Capital of Italy?"},
                {"role": "assistant", "content": "Rome."}, {"role": "user", "content": "And of France?"}]
    ids = encode_chat(oracle.tokenizer, rendered)
    want = generate(oracle, ids, temperature=0, max_new_tokens=10)
    got = chat(client, messages=sent, temperature=0, max_tokens=10)
    assert got.choices[0].message.content == want.text
    assert got.usage.prompt_tokens == len(ids)


def test_streamed_chat(client, oracle):
    want = generate(oracle, QUESTION, chat=True, temperature=0, max_new_tokens=oracle.config.max_seq_len)
    chunks = streamed(client, "chat", messages=user(QUESTION), temperature=0, stream_options={"include_usage": True})
    first, *pieces, last, usage = chunks
    assert first.choices[0].delta.role == "assistant" and first.choices[0].delta.content == ""
    assert "".join(c.choices[0].delta.content for c in pieces) == want.text
    assert all(c.choices[0].finish_reason is None for c in [first, *pieces])
    assert last.choices[0].finish_reason == "stop" and last.choices[0].delta.content is None
    assert usage.choices == [] and usage.usage.completion_tokens == len(want.token_ids)
    assert {c.object for c in chunks} == {"chat.completion.chunk"}
    plain = streamed(client, "chat", messages=user(QUESTION), temperature=0, max_tokens=4)
    assert plain[-1].usage is None and plain[-1].choices[0].finish_reason == "length"  # no usage chunk unasked


def test_chat_logprobs_are_generates(client, oracle):
    want = generate(oracle, QUESTION, chat=True, temperature=0, max_new_tokens=5, logprobs=2)
    got = chat(client, messages=user(QUESTION), temperature=0, max_tokens=5, logprobs=True, top_logprobs=2)
    content = got.choices[0].logprobs.content
    decode = oracle.tokenizer.decode
    assert [t.token for t in content] == [decode([t]) for t in want.token_ids]
    assert [bytes(t.bytes) for t in content] == [decode([t]).encode() for t in want.token_ids]
    assert [t.logprob for t in content] == pytest.approx(want.logprobs, abs=1e-6)
    for entry, step in zip(content, want.top_logprobs):
        assert [(a.token, a.logprob) for a in entry.top_logprobs] == \
            [(decode([token]), pytest.approx(value, abs=1e-6)) for token, value in step]
    # an EOS is no token of the answer: the logprobs hold the text's tokens only
    ended = chat(client, messages=user(QUESTION), temperature=0, logprobs=True).choices[0]
    assert ended.finish_reason == "stop"
    assert "".join(t.token for t in ended.logprobs.content) == ended.message.content
    # streamed: the choice's log-probs come with its finish reason, all at once
    chunks = streamed(client, "chat", messages=user(QUESTION), temperature=0, logprobs=True)
    assert [c.choices[0].logprobs is None for c in chunks] == [True] * (len(chunks) - 1) + [False]
    assert chunks[-1].choices[0].logprobs.model_dump() == ended.logprobs.model_dump()


# ---------------------------------------------------------------------------------- errors

BAD_REQUESTS = [  # (endpoint, request, what the message says, param)
    ("completions", dict(prompt="Hi", temperature=-1), ["temperature=-1 is invalid"], "temperature"),
    ("completions", dict(prompt="Hi", max_tokens=-1), ["max_tokens=-1 is invalid", ">= 0"], "max_tokens"),
    ("completions", dict(prompt="Hi", n=0), ["n=0 is invalid", "[1, 128]"], "n"),
    ("completions", dict(prompt="Hi", stop=["a", "b", "c", "d", "e"]), ["stop has 5 strings", "at most 4"], "stop"),
    ("completions", dict(prompt="Hi", logprobs=6), ["logprobs=6 is invalid", "[0, 5]"], "logprobs"),
    ("completions", dict(prompt="Hi", suffix="end"), ['suffix="end" is not supported'], "suffix"),
    ("completions", dict(prompt="Hi", best_of=2), ["best_of=2 is not supported", "n choices"], "best_of"),
    ("completions", dict(prompt=list(range(9000))), ["the prompt is 9000 tokens", "context of 8192 tokens"],
     "prompt"),
    ("completions", dict(prompt=[5, 99999]), ["prompt token id 99999 is outside", "vocabulary 0..49151"], "prompt"),
    ("completions", dict(prompt="Hi", logit_bias={"99999": 5}), ["logit_bias names token id 99999",
                                                                 "vocabulary 0..49151"], "logit_bias"),
    ("completions", dict(prompt="Hi", logit_bias={"13": 500}), ["logit_bias[13]=500 is invalid",
                                                                "[-100, 100]"], "logit_bias"),
    ("completions", dict(prompt="Hi", extra_body={"repeat_penalty": 0}), ["repeat_penalty=0 is invalid"],
     "repeat_penalty"),
    ("completions", dict(prompt="Hi", extra_body={"temperture": 0.5}),
     ["unknown field 'temperture'", "did you mean 'temperature'?"], "temperture"),
    ("completions", dict(prompt=[]), ["prompt=[] is invalid"], "prompt"),
    ("chat", dict(messages=[]), ["messages=[] is invalid"], "messages"),
    ("chat", dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
     ["messages[0].content[0] is a 'image_url' part", "text parts only"], "messages"),
    ("chat", dict(messages=[{"role": "tool", "content": "4", "tool_call_id": "1"}]),
     ["messages[0].tool_call_id is not supported", "tool calling"], "messages"),
    ("chat", dict(messages=user("Hi"), tools=[{"type": "function", "function": {"name": "f"}}]),
     ["tools=", "is not supported: tool calling"], "tools"),
    ("chat", dict(messages=user("Hi"), response_format={"type": "json_object"}),
     ["JSON mode and structured outputs are not supported"], "response_format"),
    ("chat", dict(messages=user("Hi"), top_logprobs=2), ['top_logprobs=2 needs "logprobs": true'], "top_logprobs"),
    ("chat", dict(messages=user("Hi"), max_tokens=0), ["max_tokens=0 is invalid", ">= 1"], "max_tokens"),
    ("chat", dict(messages=user("Hi"), stream_options={"include_usage": True}),
     ["stream_options is only for streamed answers"], "stream_options"),
    ("chat", dict(messages=user("Hi"), extra_body={"cache_prompt": "yes"}),
     ['cache_prompt="yes" is invalid: expected true or false'], "cache_prompt"),
]


@pytest.mark.parametrize("endpoint, request_fields, fragments, param", BAD_REQUESTS,
                         ids=[f"{e}-{'-'.join(r)}" for e, r, _, _ in BAD_REQUESTS])
def test_a_bad_request_is_a_400_naming_the_field(client, endpoint, request_fields, fragments, param):
    create = client.completions.create if endpoint == "completions" else client.chat.completions.create
    with pytest.raises(openai.BadRequestError) as caught:
        create(model=NAME, **request_fields)
    error = caught.value
    assert error.status_code == 400 and error.type == "invalid_request_error" and error.param == param
    for fragment in fragments:
        assert fragment in error.message, error.message


@pytest.mark.parametrize("endpoint, request_fields, param", [
    ("completions", dict(prompt=list(range(9000))), "prompt"),
    ("completions", dict(prompt=[[1, 2], list(range(9000))]), "prompt"),
    ("chat", dict(messages=user("Hello " * 9000)), "messages"),
    ("chat", dict(messages=user("Hello " * 4100 + "Hi " * 4100)), "messages"),  # refused by its exact length
])
def test_a_prompt_past_the_context_is_openais_context_length_exceeded(client, endpoint, request_fields, param):
    """The code clients look for to shorten a conversation (LiteLLM's ContextWindowExceededError)."""
    create = client.completions.create if endpoint == "completions" else client.chat.completions.create
    with pytest.raises(openai.BadRequestError) as caught:
        create(model=NAME, max_tokens=1, **request_fields)
    error = caught.value
    assert (error.status_code, error.param, error.code) == (400, param, "context_length_exceeded")
    assert "longer than the model's context of 8192 tokens" in error.message, error.message


@pytest.mark.parametrize("body, fragment", [(b"{not json", "the request body is not JSON"),
                                            (b"[1, 2]", "is a JSON list, not an object"),
                                            (b"", "the request has no body")])
def test_a_body_that_is_no_json_object_is_a_400(server, body, fragment):
    status, answer, _ = http(server, "/v1/completions", "POST", body)
    assert status == 400 and fragment in answer["error"]["message"]
    assert answer["error"]["type"] == "invalid_request_error"


def test_unknown_path_wrong_method_and_huge_body(server):
    status, answer, _ = http(server, "/v2/completions")
    assert status == 404 and "no such endpoint: /v2/completions" in answer["error"]["message"]
    status, answer, headers = http(server, "/v1/completions")
    assert status == 405 and headers["Allow"] == "POST" and "GET /v1/completions is not allowed" in \
        answer["error"]["message"]
    status, answer, _ = http(server, "/v1/completions", "POST", b" " * (16 * 2 ** 20 + 1))
    assert status == 413 and "more than the 16777216 bytes" in answer["error"]["message"]
    assert http(server, "/health")[0] == 200  # and it still answers


def test_head_options_and_a_method_no_route_takes(server, oracle):
    """HEAD is a GET without its body; OPTIONS answers a browser's CORS preflight, and every
    answer lets a page of any origin read it; a method the server has no handler for is an
    error object too, not the stdlib's HTML page. All on one kept-alive connection."""
    connection = HTTPConnection(*server.server_address[:2], timeout=60)
    connection.request("HEAD", "/health")
    head = connection.getresponse()
    assert (head.status, head.read(), head.headers["Content-Length"]) == (200, b"", str(len('{"status": "ok"}')))
    connection.request("HEAD", "/v1/completions")
    head = connection.getresponse()
    assert (head.status, head.read(), head.headers["Allow"]) == (405, b"", "POST")
    page = {"Origin": "http://localhost:3000"}
    connection.request("OPTIONS", "/v1/chat/completions", headers={
        **page, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})
    preflight = connection.getresponse()
    assert (preflight.status, preflight.read()) == (204, b"")
    assert (preflight.headers["Access-Control-Allow-Origin"], preflight.headers["Access-Control-Allow-Methods"],
            preflight.headers["Access-Control-Allow-Headers"]) == ("*", "POST", "authorization, content-type")
    connection.request("POST", "/v1/completions", headers={**page, "Content-Type": "application/json"},
                       body=json.dumps({"model": NAME, "prompt": PROMPT, "max_tokens": 2, "temperature": 0}))
    answer = connection.getresponse()
    assert answer.status == 200 and answer.headers["Access-Control-Allow-Origin"] == "*"
    assert json.loads(answer.read())["choices"][0]["text"] == \
        generate(oracle, PROMPT, max_new_tokens=2, temperature=0).text
    connection.request("FOO", "/v1/models")
    refused = connection.getresponse()
    assert (refused.status, refused.headers["Content-Type"]) == (501, "application/json")
    assert json.loads(refused.read()) == {"error": {
        "message": "Unsupported method ('FOO'); use GET or POST (HEAD and OPTIONS too).",
        "type": "invalid_request_error", "param": None, "code": None}}
    connection.close()


def test_a_burst_of_connections_waits_to_be_accepted_not_dropped():
    """Connections that come together (an async client's fan-out; a UI that polls while
    ``lucidlm serve`` loads its model, listening but not accepting yet) wait in the listen
    backlog. socketserver's backlog of 5 dropped the others, which retried after 1, 3, 7 s:
    past the openai client's 5 s to connect for many of a few hundred."""
    served = OpenAIServer(None, NAME, port=0)  # listening, not accepting: as while the model loads
    connections = []
    try:
        for _ in range(64):
            connections.append(socket.create_connection(served.server_address[:2], timeout=0.5))
        threading.Thread(target=served.serve_forever, daemon=True).start()
        answers = []
        for connection in connections:
            connection.settimeout(60)
            connection.sendall(b"GET /health HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n")
            received = b""
            while data := connection.recv(4096):
                received += data
            answers.append(received)
        # answered, every one (no model here: as while it loads, 503 "Loading model")
        assert all(a.startswith(b"HTTP/1.1 503 ") and b"Loading model" in a for a in answers)
    finally:
        for connection in connections:
            connection.close()
        if len(connections) == 64:  # serve_forever runs: stop it
            served.shutdown()
        served.server_close()


def test_while_the_model_loads_every_route_answers_503_loading_model():
    """``lucidlm serve`` accepts before it loads the model: a health check or a request then gets
    llama-server's 503 "Loading model" (an error object, type unavailable_error), not an
    unanswered connection; once the model is set, the same server answers."""
    import lucidlm

    served = OpenAIServer(None, NAME, port=0)
    served.start_accepting()
    try:
        for path, method, body in [("/health", "GET", None), ("/v1/models", "GET", None),
                                   ("/v1/completions", "POST", json.dumps({"prompt": "Hi"}).encode()),
                                   ("/tokenize", "POST", json.dumps({"prompt": "Hi"}).encode())]:
            status, answer, _ = http(served, path, method, body)
            assert status == 503, path
            assert answer["error"]["type"] == "unavailable_error" and "Loading model" in answer["error"]["message"]
        assert http(served, "/nowhere")[0] == 404  # an unknown path is still one
        served.model = lucidlm.load()
        assert http(served, "/health")[:2] == (200, {"status": "ok"})
    finally:
        served.stop_accepting()
        served.server_close()


@pytest.mark.parametrize("path", ["alone", "batch"])
def test_an_unexpected_exception_is_a_500_and_the_server_goes_on(client, oracle, monkeypatch, capsys, path):
    """A generation that fails, run alone (a seeded sample) or as a batch others may join
    (greedy, continuous batching)."""
    from lucidlm.generation.batch_run import BatchRun
    from lucidlm.serving import openai_protocol

    def broken(*args, **kwargs):
        raise RuntimeError("the decode step fell over")

    monkeypatch.setattr(openai_protocol, "stream", broken)
    monkeypatch.setattr(BatchRun, "pieces", broken)
    request = dict(temperature=0.7, seed=3) if path == "alone" else dict(temperature=0)
    with pytest.raises(openai.InternalServerError, match="RuntimeError: the decode step fell over"):
        completion(client, prompt=PROMPT, max_tokens=2, **request)
    assert "Traceback" in capsys.readouterr().err  # logged for whoever runs the server
    monkeypatch.undo()
    got = completion(client, prompt=PROMPT, max_tokens=2, temperature=0)
    assert got.choices[0].text == generate(oracle, PROMPT, max_new_tokens=2, temperature=0).text


# ---------------------------------------------------------------------------------- one model, shared

def test_requests_at_once_take_turns_on_the_model(server, oracle):
    """Four clients at once (two streaming): one KV cache, so they must run one after the other;
    each answer is still its own prompt's."""
    prompts = [PROMPT, "Once upon a time", "The capital of Italy is", "1, 2, 3,"]
    wants = [generate(oracle, p, max_new_tokens=8, temperature=0).text for p in prompts]
    answers = [None] * len(prompts)

    def ask(i: int) -> None:
        own = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=120)  # own connection
        if i % 2:
            answers[i] = "".join(c.choices[0].text for c in own.completions.create(
                model=NAME, prompt=prompts[i], max_tokens=8, temperature=0, stream=True))
        else:
            answers[i] = own.completions.create(model=NAME, prompt=prompts[i], max_tokens=8,
                                                temperature=0).choices[0].text

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert answers == wants


def test_a_client_that_leaves_mid_stream_frees_the_model(client, server, oracle):
    """The first request would write ~8,000 tokens (its end banned), minutes of work; its client
    reads three chunks and hangs up. The next request is answered within seconds: the first
    generation stopped when its client left, and let go of the model."""
    from lucidlm.weights.hf_generation_config import end_token_ids

    endless = client.completions.create(model=NAME, prompt="Count: 1, 2, 3,", stream=True, temperature=0,
                                        max_tokens=8000, logit_bias={str(i): -100 for i in end_token_ids(oracle)})
    for _, _ in zip(range(3), endless):
        pass
    endless.close()
    start = time.perf_counter()
    quick = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=60)
    got = quick.completions.create(model=NAME, prompt=PROMPT, max_tokens=4, temperature=0)
    assert got.choices[0].text == generate(oracle, PROMPT, max_new_tokens=4, temperature=0).text
    assert time.perf_counter() - start < 30


def wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + 60
    while not condition():
        assert time.monotonic() < deadline, f"waited 60 s for {what}"
        time.sleep(0.01)


@pytest.fixture(scope="module")
def one_at_a_time():
    """A server that runs one request at a time (--parallel 1): each generation alone, as a stream."""
    with served(lucidlm.load(), parallel=1) as server:
        yield server


def test_a_client_that_leaves_before_its_answer_frees_the_model(one_at_a_time, oracle, monkeypatch):
    """Clients that give up on an answer (their timeout, Ctrl-C) and close their connection:
    one still waiting its turn gets no generation at all, one whose answer is being generated
    (not streamed) stops it at the next piece. The request behind them does not wait for
    answers nobody will read. (In a batch: test_batched_serving.py.)"""
    import lucidlm.serving.openai_protocol as protocol
    from lucidlm.weights.hf_generation_config import end_token_ids

    server = one_at_a_time
    client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=120)

    opened = []  # (prompt, its generation) of every generation the server opens

    def recorded_stream(model, prompt, **kwargs):
        opened.append((prompt, protocol.stream.__wrapped__(model, prompt, **kwargs)))
        return opened[-1][1]

    recorded_stream.__wrapped__ = protocol.stream
    monkeypatch.setattr(protocol, "stream", recorded_stream)
    endless = dict(max_tokens=2000, temperature=0, logit_bias={str(i): -100 for i in end_token_ids(oracle)})

    def leaving_client(prompt: str) -> socket.socket:
        """A connection that sends its request and will read nothing."""
        body = json.dumps(dict(model=NAME, prompt=prompt, **endless)).encode()
        connection = socket.create_connection(server.server_address[:2])
        connection.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                           b"Content-Length: %d\r\n\r\n%b" % (len(body), body))
        return connection

    holding = client.completions.create(model=NAME, prompt=PROMPT, stream=True, **endless)
    next(iter(holding))  # its generation holds the model
    queued = leaving_client("Queued: 1, 2, 3,")
    wait_until(lambda: server.model_turn.waiting == 1, "the second request to queue")
    queued.close()
    holding.close()
    started = leaving_client("Started: 1, 2, 3,")
    wait_until(lambda: opened[-1][0] == "Started: 1, 2, 3,", "the third request's generation")
    started.close()
    got = completion(client, prompt=PROMPT, max_tokens=4, temperature=0)
    assert got.choices[0].text == generate(oracle, PROMPT, max_new_tokens=4, temperature=0).text
    assert [prompt for prompt, _ in opened] == [PROMPT, "Started: 1, 2, 3,", PROMPT]  # none for the queued one
    assert [pieces.result is None for _, pieces in opened] == [True, True, False]  # the first two closed unfinished


def test_a_client_that_stops_reading_its_stream_is_let_go(server, oracle, monkeypatch, capsys):
    """A streaming client that reads nothing more (stalled, not gone): once a write has waited
    the handler's timeout (600 s; 1 s here, with small socket buffers to fill) the server gives
    it up as a client gone, closes its connection and passes the model on; no traceback that
    calls it a bug, and no error event written to a connection that takes nothing."""
    from lucidlm.serving.http_server import OpenAIRequestHandler
    from lucidlm.weights.hf_generation_config import end_token_ids

    plain_setup = OpenAIRequestHandler.setup

    def small_buffers(handler):
        plain_setup(handler)
        handler.connection.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)

    monkeypatch.setattr(OpenAIRequestHandler, "timeout", 1)
    monkeypatch.setattr(OpenAIRequestHandler, "setup", small_buffers)
    body = json.dumps({"model": NAME, "prompt": PROMPT, "max_tokens": 4000, "temperature": 0, "stream": True,
                       "logit_bias": {str(i): -100 for i in end_token_ids(oracle)}}).encode()
    with socket.socket() as stalled:
        stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        stalled.connect(server.server_address[:2])
        stalled.sendall(b"POST /v1/completions HTTP/1.1\r\nContent-Type: application/json\r\n"
                        b"Content-Length: %d\r\n\r\n%b" % (len(body), body))
        quick = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=60)
        got = quick.completions.create(model=NAME, prompt=PROMPT, max_tokens=3, temperature=0)  # after the stall
        quick.close()
        stalled.settimeout(60)
        received = b""
        while data := stalled.recv(65536):  # what the server sent, up to its closing the connection
            received += data
    assert got.choices[0].text == generate(oracle, PROMPT, max_new_tokens=3, temperature=0).text
    assert received.startswith(b"HTTP/1.1 200 OK") and b'"error"' not in received
    assert not received.endswith(b"0\r\n\r\n")  # cut off: no end of the chunked body
    assert "Traceback" not in capsys.readouterr().err


def test_a_server_that_drafts_gives_the_same_answers(oracle, monkeypatch):
    """``lucidlm serve --draft prompt``: every request decodes speculatively (no OpenAI field asks
    for it), with plain greedy's text, streamed or not, and the server's draft_tokens."""
    import lucidlm.serving.openai_protocol as protocol

    paragraph = "The quick brown fox jumps over the lazy dog, and the lazy dog sleeps on under the old tree."
    messages = [{"role": "user", "content": f"Repeat exactly: {paragraph}"}]
    opened = []  # every generation the server opens, to read its speculation counts after

    def recorded_stream(*args, **kwargs):
        opened.append(protocol.stream.__wrapped__(*args, **kwargs))
        return opened[-1]

    recorded_stream.__wrapped__ = protocol.stream
    monkeypatch.setattr(protocol, "stream", recorded_stream)
    served = OpenAIServer(lucidlm.load(), NAME, port=0, generation_options={"draft": "prompt", "draft_tokens": 4})
    threading.Thread(target=served.serve_forever, daemon=True).start()
    try:
        client = openai.OpenAI(base_url=served.url, api_key="unused", max_retries=0, timeout=120)
        want = generate(oracle, encode_chat(oracle.tokenizer, messages), temperature=0, max_new_tokens=40)
        answer = chat(client, messages=messages, temperature=0, max_tokens=40)
        assert answer.choices[0].message.content == want.text
        assert answer.usage.completion_tokens == len(want.token_ids)
        chunks = streamed(client, "chat", messages=messages, temperature=0, max_tokens=40)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text
        stats = [pieces.result.speculation for pieces in opened]
        assert len(stats) == 2 and all(s is not None and s.accepted > 0 for s in stats), stats
        assert all(s.drafted <= 4 * s.rounds for s in stats)  # the server's draft_tokens
    finally:
        served.shutdown()
        served.server_close()


def test_cache_prompt_runs_only_the_new_turn_with_the_same_answers(server, client, oracle, monkeypatch):
    """llama.cpp's ``cache_prompt``: a chat's second turn (the first turn, its answer and a new
    message) reuses the first request's KV cache, here asked per request; the answers stay
    plain greedy's (generate() on the oracle, each turn's prompt run whole)."""
    import lucidlm.serving.openai_protocol as protocol

    opened = []

    def recorded_stream(*args, **kwargs):
        opened.append(protocol.stream.__wrapped__(*args, **kwargs))
        return opened[-1]

    recorded_stream.__wrapped__ = protocol.stream
    monkeypatch.setattr(protocol, "stream", recorded_stream)
    turns = [user("Name a colour of the sky.")]
    first = chat(client, messages=turns[0], temperature=0, max_tokens=24, extra_body={"cache_prompt": True})
    second_turn = [*turns[0], {"role": "assistant", "content": first.choices[0].message.content},
                   *user("And of grass?")]
    second = chat(client, messages=second_turn, temperature=0, max_tokens=24, extra_body={"cache_prompt": True})
    for messages, answer in ((turns[0], first), (second_turn, second)):
        want = generate(oracle, encode_chat(oracle.tokenizer, messages), temperature=0, max_new_tokens=24)
        assert answer.choices[0].message.content == want.text
    assert opened[0].result.cached_tokens == 0
    # all of the first prompt and answer but its end token's slot, which the template's own
    # end-of-turn token may or may not match: at least the first prompt
    assert opened[1].result.cached_tokens >= len(opened[0].result.prompt_ids)


def test_echo_with_logprobs_lines_up_with_the_text_when_the_tokenizer_adds_bos(gemma3):
    """Gemma 3 reads a text prompt with a BOS first: the BOS is scored (null, no context) but adds
    nothing to the echoed text, so the tokens still join to the text and each offset is where its
    token's text begins; a prompt of ids echoes its BOS as text, and keeps it in the tokens."""
    prompt = "  spaced\tout  café 🙂 text"
    with served(gemma3) as server:
        def scored(given):
            request = dict(model=NAME, prompt=given, max_tokens=3, temperature=0, echo=True, logprobs=1)
            return http(server, "/v1/completions", "POST", json.dumps(request).encode())[1]

        scores = prompt_logprobs(gemma3, prompt, top=1)
        body, ids = scored(prompt), scored(scores.token_ids)
    assert scores.token_ids[0] == gemma3.tokenizer.bos_id  # the case this test means
    for answer, echoed in [(body, prompt), (ids, gemma3.tokenizer.decode(scores.token_ids))]:
        choice = answer["choices"][0]
        text, logprobs = choice["text"], choice["logprobs"]
        assert text.startswith(echoed) and "".join(logprobs["tokens"]) == text
        assert logprobs["text_offset"] == [len("".join(logprobs["tokens"][:i])) for i in range(len(logprobs["tokens"]))]
        assert logprobs["token_logprobs"][0] is None
        assert logprobs["token_logprobs"][1:len(scores.token_ids)] == pytest.approx(scores.logprobs[1:], abs=1e-5)
    assert ids["choices"][0]["logprobs"]["tokens"][0] == "<bos>" and body["choices"][0]["logprobs"]["tokens"][0] == ""


def test_echo_with_logprobs_of_an_empty_prompt_scores_the_bos_it_starts_from_as_no_text(server):
    """An empty text prompt starts from the BOS (SmolLM2's tokenizer adds none of its own): the
    echoed text is "", so the BOS adds nothing to it and the answer's first token is at 0."""
    body = http(server, "/v1/completions", "POST", json.dumps(dict(model=NAME, prompt="", max_tokens=2, temperature=0,
                                                                    echo=True, logprobs=1)).encode())[1]
    choice = body["choices"][0]
    assert choice["logprobs"]["tokens"][0] == "" and choice["logprobs"]["token_logprobs"][0] is None
    assert "".join(choice["logprobs"]["tokens"]) == choice["text"]
    assert choice["logprobs"]["text_offset"][:2] == [0, 0]
