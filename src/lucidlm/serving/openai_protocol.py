"""OpenAI's /v1/completions and /v1/chat/completions on lucidlm's generation.

A request's JSON is checked field by field (``parse_completion_request``,
``parse_chat_request``: a 400 naming the field, before the request waits for the model).
Holding the model, ``start`` opens one ``generation.stream`` per choice, which checks what
needs the model (a prompt past the context, a token id past the vocabulary) before any token
is generated; the choices then run one after the other, answered as one response object
(``response``) or as stream chunks (``chunks``), the dicts the openai client parses.

``n`` choices are n generations in turn, choice j with seed ``seed + j``: each is what
``generate(..., seed=seed + j)`` gives (greedy: n copies), and streams the same way.
Options a request leaves out take the model's sampling defaults, as ``lucidlm generate``
does (SmolLM2: temperature 0.2, top-p 0.5), else temperature 1, OpenAI's default.
"""

from __future__ import annotations

import re
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Union

from lucidlm.errors import LucidLMError
from lucidlm.generation import TextStream, stream
from lucidlm.generation.prompt_logprobs import prompt_logprobs
from lucidlm.generation.request import fit_to_context, prompt_ids
from lucidlm.serving.api_errors import RequestError, as_request_error
from lucidlm.serving.chat_messages import template_messages
from lucidlm.serving.logprob_objects import (ScoredToken, chat_logprobs, completion_logprobs, scored_prompt,
                                             scored_tokens, shifted)
from lucidlm.serving.request_fields import (COMMON_FIELDS, MAX_N, choice_seed, flag, given_fields,
                                            sampling_options, shown, stream_flags, whole_number)

COMPLETION_FIELDS = (*COMMON_FIELDS, "prompt", "max_tokens", "logprobs", "echo", "suffix", "best_of")
CHAT_FIELDS = (*COMMON_FIELDS, "messages", "max_tokens", "max_completion_tokens", "logprobs", "top_logprobs",
               "response_format", "tools", "tool_choice", "functions", "function_call", "parallel_tool_calls",
               "audio", "modalities", "prediction", "reasoning_effort", "verbosity", "web_search_options")
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}  # generate's -> OpenAI's
# generate's refusals of the prompt itself: past the context ("the prompt is 9000 tokens, longer than the
# model's context ..."), empty with no BOS, a token id past the vocabulary
_PROMPT_REFUSED = re.compile(r"^(the (chat )?prompt is |prompt token id )")

Prompt = Union[str, list[int]]


@dataclass
class Choice:
    index: int  # its place in the response's choices
    first: bool  # the first choice of its prompt (whose prompt tokens usage counts)
    pieces: TextStream  # or, in a batch (--parallel), a RowFeed: the same three calls


class GenerationJob:
    """One request's choices: its prompts, each generated ``n`` times with ``options``."""

    object_name = chunk_object_name = id_prefix = prompt_field = ""

    def __init__(self, prompts: list[Any], n: int, options: dict[str, Any], names: dict[str, str],
                 seed: Optional[int], streaming: bool, include_usage: bool, logprobs: Optional[int]) -> None:
        self.prompts, self.n, self.options, self.names, self.seed = prompts, n, options, names, seed
        self.stream, self.include_usage, self.logprobs = streaming, include_usage, logprobs
        self.choices: list[Choice] = []

    def start(self, model: Any, model_name: str, server_options: Optional[dict[str, Any]] = None) -> None:
        """Open every choice's generation on ``model`` (the caller holds it until ``close``);
        ``server_options``: generation options of the server's own, under every request's
        (``lucidlm serve --draft``: speculative decoding, which no OpenAI field names)."""
        options = self.options_for(model, server_options)
        self.begin(model, model_name)
        with model_refusals(self):
            prompts = [self.prompt_for_model(prompt) for prompt in self.prompts]
            self.choices = [Choice(i * self.n + j, j == 0,
                                   stream(model, prompt, steady=True, seed=choice_seed(self.seed, j), **options))
                            for i, prompt in enumerate(prompts) for j in range(self.n)]

    def start_in_batch(self, model: Any, model_name: str, rows: list[Any]) -> None:
        """Answer from ``rows``, one per choice in ``batch_rows``' order: each a ``TextStream``
        alike (pieces, ``result``, ``close``) fed by a batch another thread decodes."""
        self.begin(model, model_name)
        self.choices = [Choice(index, index % self.n == 0, row) for index, row in enumerate(rows)]

    def begin(self, model: Any, model_name: str) -> None:
        self.model, self.model_name = model, model_name
        self.id = f"{self.id_prefix}{uuid.uuid4().hex}"
        self.created = int(time.time())

    def options_for(self, model: Any, server_options: Optional[dict[str, Any]]) -> dict[str, Any]:
        """The generation options of every choice: the server's, the request's on top."""
        return {**(server_options or {}), **self.options}

    def batch_rows(self, model: Any) -> list[list[int]]:
        """Every choice's prompt as checked token ids (choice i * n + j is prompt i), for a
        batch; a prompt the model refuses is the request's 400, as in ``start``."""
        self.model = model
        with model_refusals(self):
            rows = [prompt_ids(model, self.prompt_for_model(prompt), chat=False) for prompt in self.prompts]
            for row in rows:  # its exact length: a prompt past the context would fail the whole batch
                fit_to_context(model, [row], 0)
        return [row for row in rows for _ in range(self.n)]

    def close(self) -> None:
        """End every generation (a client gone mid-stream: its tokens stop here)."""
        for choice in self.choices:
            choice.pieces.close()

    def response(self, abandoned: Callable[[], bool] = lambda: False) -> dict[str, Any]:
        """The whole answer; ``abandoned`` is asked at each piece of text whether the client
        left, and then the generation ends there (``ConnectionAbortedError``)."""
        answers = []
        for choice in self.choices:
            for _ in choice.pieces:  # generate() is this loop
                if abandoned():
                    raise ConnectionAbortedError("the client closed its connection")
            answers.append(self.answer(choice.index, choice.pieces.result))
        return self.envelope(self.object_name, choices=answers, usage=self.usage())

    def chunks(self) -> Iterator[dict[str, Any]]:
        for choice in self.choices:
            yield from self.opening_chunks(choice.index)
            for piece in choice.pieces:
                yield self.piece_chunk(choice.index, piece)
            yield self.closing_chunk(choice.index, choice.pieces.result)
        if self.include_usage:
            yield self.envelope(self.chunk_object_name, choices=[], usage=self.usage())

    def usage(self) -> dict[str, int]:
        prompt = sum(len(c.pieces.result.prompt_ids) for c in self.choices if c.first)
        completion = sum(len(c.pieces.result.token_ids) for c in self.choices)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def envelope(self, object_name: str, **fields: Any) -> dict[str, Any]:
        return {"id": self.id, "object": object_name, "created": self.created, "model": self.model_name, **fields}

    def logprobs_of(self, result: Any) -> Any:
        return None if self.logprobs is None else scored_tokens(self.model.tokenizer, result)

    # what each endpoint fills in
    def prompt_for_model(self, prompt: Any) -> Prompt:
        raise NotImplementedError

    def answer(self, index: int, result: Any) -> dict[str, Any]:
        raise NotImplementedError

    def opening_chunks(self, index: int) -> Iterator[dict[str, Any]]:
        raise NotImplementedError

    def piece_chunk(self, index: int, piece: str) -> dict[str, Any]:
        raise NotImplementedError

    def closing_chunk(self, index: int, result: Any) -> dict[str, Any]:
        raise NotImplementedError


class CompletionJob(GenerationJob):
    object_name = chunk_object_name = "text_completion"
    id_prefix, prompt_field = "cmpl-", "prompt"

    def __init__(self, *args: Any, echo: bool, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.echo = echo
        self.prompt_scores: list[Any] = []  # per prompt, with echo and logprobs: generation.prompt_logprobs'

    def start(self, model: Any, model_name: str, server_options: Optional[dict[str, Any]] = None) -> None:
        super().start(model, model_name, server_options)  # the prompts checked, no token generated yet
        if self.echo and self.logprobs is not None:  # one more pass over each prompt, while the model is held
            self.prompt_scores = [prompt_logprobs(model, prompt, top=self.logprobs) for prompt in self.prompts]

    def prompt_for_model(self, prompt: Prompt) -> Prompt:
        return prompt

    def prompt_text(self, index: int) -> str:
        """The prompt of choice ``index`` as text, for echo."""
        prompt = self.prompts[index // self.n]
        return prompt if isinstance(prompt, str) else self.model.tokenizer.decode(prompt)

    def answer(self, index: int, result: Any) -> dict[str, Any]:
        text = (self.prompt_text(index) if self.echo else "") + result.text
        return {"index": index, "text": text, "logprobs": self.completion_logprobs(result, index),
                "finish_reason": FINISH_REASONS[result.finish_reason]}

    def completion_logprobs(self, result: Any, index: int, with_prompt: bool = True) -> Optional[dict[str, Any]]:
        """The answer's log-probs; after an echoed prompt (echo with logprobs), its offsets count
        from the start of the prompt's text, and ``with_prompt`` puts the prompt's tokens first."""
        tokens = self.logprobs_of(result)
        if tokens is None:
            return None
        if self.prompt_scores:
            tokens = shifted(tokens, len(self.prompt_text(index)))
            if with_prompt:
                tokens = self.prompt_tokens(index) + tokens
        return completion_logprobs(tokens, with_top=bool(self.logprobs))

    def prompt_tokens(self, index: int) -> list[ScoredToken]:
        prompt, scores, tokenizer = self.prompts[index // self.n], self.prompt_scores[index // self.n], \
            self.model.tokenizer
        # echo gives the text as sent, without the BOS the tokenizer adds (or an empty prompt starts from)
        added_bos = isinstance(prompt, str) and (bool(getattr(tokenizer, "add_bos", False)) or not prompt) and \
            scores.token_ids[:1] == [tokenizer.bos_id]
        return scored_prompt(tokenizer, scores, added_bos)

    def opening_chunks(self, index: int) -> Iterator[dict[str, Any]]:
        if self.echo:  # the prompt's log-probs with it (the answer's come in the closing chunk)
            logprobs = completion_logprobs(self.prompt_tokens(index), bool(self.logprobs)) \
                if self.prompt_scores else None
            yield self.piece_chunk(index, self.prompt_text(index), logprobs=logprobs)

    def piece_chunk(self, index: int, piece: str, finish_reason: Optional[str] = None,
                    logprobs: Optional[dict[str, Any]] = None) -> dict[str, Any]:
        return self.envelope(self.chunk_object_name, choices=[
            {"index": index, "text": piece, "logprobs": logprobs, "finish_reason": finish_reason}])

    def closing_chunk(self, index: int, result: Any) -> dict[str, Any]:
        """No text: the finish reason, and the log-probs of every token of the choice at once
        (a piece of text is not always whole tokens: a stop string's start is held back)."""
        return self.piece_chunk(index, "", FINISH_REASONS[result.finish_reason],
                                self.completion_logprobs(result, index, with_prompt=False))  # the prompt's came first


class ChatJob(GenerationJob):
    object_name, chunk_object_name = "chat.completion", "chat.completion.chunk"
    id_prefix, prompt_field = "chatcmpl-", "messages"

    def prompt_for_model(self, messages: list[dict[str, str]]) -> Prompt:
        """The conversation in the model's chat template, as ids (what ``Conversation.reply`` runs;
        one user message gives ``generate(text, chat=True)``'s prompt)."""
        from lucidlm.generation.chat_template import encode_chat

        return encode_chat(self.model.tokenizer, messages, context=self.model.config.max_seq_len)

    def options_for(self, model: Any, server_options: Optional[dict[str, Any]]) -> dict[str, Any]:
        # no max_tokens: until the end of the answer, or of the context (generate stops there)
        return {"max_new_tokens": model.config.max_seq_len, **super().options_for(model, server_options)}

    def answer(self, index: int, result: Any) -> dict[str, Any]:
        return {"index": index, "message": {"role": "assistant", "content": result.text},
                "logprobs": self.chat_logprobs(result), "finish_reason": FINISH_REASONS[result.finish_reason]}

    def chat_logprobs(self, result: Any) -> Optional[dict[str, Any]]:
        tokens = self.logprobs_of(result)
        return None if tokens is None else chat_logprobs(tokens)

    def opening_chunks(self, index: int) -> Iterator[dict[str, Any]]:
        yield self.delta_chunk(index, {"role": "assistant", "content": ""})

    def piece_chunk(self, index: int, piece: str) -> dict[str, Any]:
        return self.delta_chunk(index, {"content": piece})

    def closing_chunk(self, index: int, result: Any) -> dict[str, Any]:
        """An empty delta with the finish reason, and the choice's log-probs at once (see CompletionJob's)."""
        return self.delta_chunk(index, {}, FINISH_REASONS[result.finish_reason], self.chat_logprobs(result))

    def delta_chunk(self, index: int, delta: dict[str, str], finish_reason: Optional[str] = None,
                    logprobs: Optional[dict[str, Any]] = None) -> dict[str, Any]:
        return self.envelope(self.chunk_object_name, choices=[
            {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}])


@contextmanager
def model_refusals(job: GenerationJob) -> Iterator[None]:
    """generate's checks that need the model, as the request's 400 naming its field."""
    try:
        yield
    except LucidLMError as exc:
        if _PROMPT_REFUSED.match(str(exc)):  # OpenAI's code for a prompt too long, which clients look for
            code = "context_length_exceeded" if "context" in str(exc) else None
            raise RequestError(str(exc), param=job.prompt_field, code=code) from None
        raise as_request_error(exc, job.names) from None


def parse_completion_request(body: dict[str, Any]) -> CompletionJob:
    fields = _request_fields(body, COMPLETION_FIELDS, "/v1/completions", "prompt",
                             "give the text to continue (or token ids, or a list of prompts)")
    prompts = _prompts(fields["prompt"])
    options, names = sampling_options(fields)
    options["max_new_tokens"] = whole_number(fields, "max_tokens", 16, low=0)  # OpenAI's default for completions
    logprobs = whole_number(fields, "logprobs", None, low=0, high=5,
                            fix="the number of likeliest tokens listed at each step (OpenAI's bound is 5)")
    echo = flag(fields, "echo")
    if logprobs is not None:
        options["logprobs"] = logprobs
    names.update(max_new_tokens="max_tokens", logprobs="logprobs")
    stream, include_usage = stream_flags(fields)
    n = whole_number(fields, "n", 1, low=1, high=MAX_N)
    return CompletionJob(prompts, n, options, names, fields.get("seed"), stream, include_usage, logprobs, echo=echo)


def parse_chat_request(body: dict[str, Any]) -> ChatJob:
    fields = _request_fields(body, CHAT_FIELDS, "/v1/chat/completions", "messages",
                             'give the conversation, e.g. [{"role": "user", "content": "Hello"}]')
    messages = template_messages(fields["messages"])
    options, names = sampling_options(fields)
    limits = {name: whole_number(fields, name, None, low=1) for name in ("max_completion_tokens", "max_tokens")}
    given = {name: value for name, value in limits.items() if value is not None}
    if len(set(given.values())) > 1:
        raise RequestError(f"max_completion_tokens={given['max_completion_tokens']} and max_tokens="
                           f"{given['max_tokens']} disagree; give one of them.", param="max_tokens")
    if given:
        name, options["max_new_tokens"] = next(iter(given.items()))
        names["max_new_tokens"] = name
    wants_logprobs = flag(fields, "logprobs", note=" (the number of alternatives is top_logprobs)")
    top = whole_number(fields, "top_logprobs", None, low=0, high=20,
                       fix="the number of likeliest tokens listed at each step (OpenAI's bound is 20)")
    if top is not None and not wants_logprobs:
        raise RequestError(f"top_logprobs={top} needs \"logprobs\": true.", param="top_logprobs")
    logprobs = (top or 0) if wants_logprobs else None
    if logprobs is not None:
        options["logprobs"], names["logprobs"] = logprobs, "top_logprobs"
    stream, include_usage = stream_flags(fields)
    n = whole_number(fields, "n", 1, low=1, high=MAX_N)
    return ChatJob([messages], n, options, names, fields.get("seed"), stream, include_usage, logprobs)


def _request_fields(body: dict[str, Any], known: tuple[str, ...], endpoint: str, required: str,
                    fix: str) -> dict[str, Any]:
    """The fields an endpoint's request gives (``given_fields``), its ``required`` one among them.
    The served model answers whatever ``model`` names (one model per server, as llama.cpp's);
    the response's ``model`` says which it is."""
    fields = given_fields(body, known, endpoint)
    if "model" in fields and not isinstance(fields["model"], str):
        raise RequestError(f"model={shown(fields['model'])} is invalid: expected the model's name (a string).",
                           param="model")
    if required not in fields:
        raise RequestError(f"{required} is missing: {fix}.", param=required)
    return fields


def _prompts(prompt: Any) -> list[Prompt]:
    """OpenAI's prompt: a text, a list of token ids, or a list of either (one prompt each)."""
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(_is_id(i) for i in prompt):
            return [prompt]
        if all(isinstance(p, str) for p in prompt):
            return list(prompt)
        if all(isinstance(p, list) and p and all(_is_id(i) for i in p) for p in prompt):
            return list(prompt)
    raise RequestError(f"prompt={shown(prompt)} is invalid: expected a string, a list of token ids (whole numbers), "
                       f"or a non-empty list of strings or of token id lists.", param="prompt")


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
