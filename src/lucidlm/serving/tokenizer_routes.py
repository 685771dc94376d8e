"""The served model's tokenizer over HTTP, as vLLM's and llama-server's servers have it:
``POST /tokenize``, ``POST /detokenize`` and ``GET /tokenizer_info``.

Why: a client that counts tokens, cuts a prompt to the context or scores a continuation needs
the model's own token ids. lm-evaluation-harness's ``local-completions`` looks for
``/tokenizer_info`` and ``/tokenize`` and then tokenizes through the server, so it evaluates a
lucidlm-served model with no tokenizer download of its own.

Both servers' field names are taken: the text as ``prompt`` (vLLM) or ``content``
(llama-server); whether to add the tokenizer's BOS as ``add_special_tokens`` (vLLM, default
true) or ``add_special`` (llama-server, default false). Text that spells a special token
(``<|endoftext|>``) becomes that token, as both servers read it. ``with_pieces`` (llama-server's)
gives each id with its text, or its bytes where a token holds part of a character.
``/detokenize`` answers the text under both names.
"""

from __future__ import annotations

from typing import Any

from lucidlm.serving.api_errors import RequestError
from lucidlm.serving.request_fields import flag, given_fields, shown

TOKENIZE_FIELDS = ("model", "prompt", "content", "add_special_tokens", "add_special", "with_pieces")
DETOKENIZE_FIELDS = ("model", "tokens")


def tokenize(model: Any, body: dict[str, Any]) -> dict[str, Any]:
    """The ids of the request's text, with their count and the model's context."""
    fields = given_fields(body, TOKENIZE_FIELDS, "/tokenize")
    given = [name for name in ("prompt", "content") if name in fields]
    if len(given) != 1:
        raise RequestError("give the text to tokenize as prompt (or content, llama-server's name), once.",
                           param="prompt")
    text = fields[given[0]]
    if not isinstance(text, str):
        raise RequestError(f"{given[0]}={shown(text)} is invalid: expected the text to tokenize (a string).",
                           param=given[0])
    if "add_special_tokens" in fields and "add_special" in fields:
        raise RequestError("give add_special_tokens (vLLM's name) or add_special (llama-server's), not both.",
                           param="add_special")
    # vLLM's add_special_tokens defaults to true, llama-server's add_special to false
    add_bos = flag(fields, "add_special") if "add_special" in fields else \
        "add_special_tokens" not in fields or flag(fields, "add_special_tokens")
    tokenizer = model.tokenizer
    ids = list(tokenizer.encode(text))  # the model's reading: its BOS first where the tokenizer adds one
    bos = tokenizer.bos_id
    if not add_bos and getattr(tokenizer, "add_bos", False) and ids[:1] == [bos]:
        ids = ids[1:]
    tokens: list[Any] = ids
    if flag(fields, "with_pieces"):  # llama-server's: each id with its text (its bytes where not whole UTF-8)
        tokens = [{"id": i, "piece": _piece(tokenizer.decode_bytes([i]))} for i in ids]
    return {"tokens": tokens, "count": len(ids), "max_model_len": model.config.max_seq_len}


def _piece(data: bytes) -> Any:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return list(data)


def detokenize(model: Any, body: dict[str, Any]) -> dict[str, Any]:
    """The text of the request's token ids."""
    fields = given_fields(body, DETOKENIZE_FIELDS, "/detokenize")
    ids = fields.get("tokens")
    vocab = model.config.vocab_size
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise RequestError(f"tokens={shown(ids)} is invalid: expected a list of token ids (whole numbers).",
                           param="tokens")
    bad = [i for i in ids if not 0 <= i < vocab]
    if bad:
        raise RequestError(f"tokens names token id {bad[0]}, outside this model's vocabulary 0..{vocab - 1}.",
                           param="tokens")
    text = model.tokenizer.decode(ids)
    return {"prompt": text, "content": text}


def tokenizer_info(model: Any) -> dict[str, Any]:
    """The tokenizer's special tokens, chat template and the model's context (vLLM's fields)."""
    tokenizer = model.tokenizer
    return {"tokenizer_class": type(tokenizer).__name__, "bos_token": tokenizer.bos_token,
            "eos_token": tokenizer.eos_token, "pad_token": tokenizer.pad_token,
            "add_bos_token": bool(getattr(tokenizer, "add_bos", False)),
            "chat_template": tokenizer.chat_template, "model_max_length": model.config.max_seq_len,
            "vocab_size": model.config.vocab_size}
