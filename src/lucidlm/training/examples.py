"""Fine-tuning data as whole examples, one JSON object per line (seed 004's lyrics
dataset, instruction tuning, chat):

    {"text": "..."}                                   plain text; the loss covers all of it
    {"prompt": "...", "completion": "..."}            the loss can skip the prompt (mask_prompt)
    {"messages": [{"role": "user", "content": ...},   rendered with the model's chat template;
                  {"role": "assistant", ...}]}        the last (assistant) turn is the completion

Each example becomes ``length`` tokens: shorter ones are padded (the padding is never a
target), longer ones are cut to ``length`` or, with ``truncate=False``, refused. Targets
are the ids shifted by one, IGNORE_INDEX where no loss counts; padding sits on the right,
so causal attention never lets a real token see it and no attention mask is needed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from lucidlm.errors import DataError
from lucidlm.tokenizers.base import starts_with_added_bos
from lucidlm.training.loss import IGNORE_INDEX

FORMATS = ("auto", "text", "prompt_completion", "messages")
FIELDS = {"text": ("text",), "prompt_completion": ("prompt", "completion"), "messages": ("messages",)}


@dataclass
class Examples:
    ids: torch.Tensor  # (N, L) int64, right-padded
    targets: torch.Tensor  # (N, L) next-token targets, IGNORE_INDEX where no loss counts
    lengths: list[int]  # tokens of each example before padding or truncation
    prompt_lengths: list[int]  # tokens of each example's prompt (0 for plain text)
    format: str


def read_jsonl(path: Path) -> list[tuple[int, dict[str, Any]]]:
    """(line number, object) for every non-blank line; anything else is a DataError naming the line."""
    records = []
    for number, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(f"{path}:{number}: not valid JSON ({exc.msg} at column {exc.colno}); each line must be "
                            f"one JSON object.") from None
        if not isinstance(value, dict):
            raise DataError(f"{path}:{number}: expected a JSON object such as {{\"text\": ...}}, got "
                            f"{type(value).__name__}; each line must be one object.")
        records.append((number, value))
    if not records:
        raise DataError(f"{path} holds no examples; write one JSON object per line.")
    return records


def detect_format(path: Path, record: dict[str, Any], number: int) -> str:
    for name in ("messages", "prompt_completion", "text"):
        if all(key in record for key in FIELDS[name]):
            return name
    raise DataError(f"{path}:{number}: the object has fields {sorted(record)}, but an example needs \"text\", or "
                    f"\"prompt\" and \"completion\", or \"messages\".")


def _field(path: Path, number: int, record: dict[str, Any], name: str, kind: type) -> Any:
    if name not in record:
        raise DataError(f"{path}:{number}: field \"{name}\" is missing (this file's examples have "
                        f"{', '.join(repr(k) for k in sorted(record)) or 'no fields'}); add it or fix the format.")
    if not isinstance(record[name], kind):
        raise DataError(f"{path}:{number}: field \"{name}\" must be a {kind.__name__}, got "
                        f"{type(record[name]).__name__}.")
    return record[name]


def encode_example(path: Path, number: int, record: dict[str, Any], fmt: str, tokenizer: Any) -> tuple[list[int], int]:
    """(token ids, how many of them are the prompt)."""
    eos = [tokenizer.eos_id] if getattr(tokenizer, "eos_id", None) is not None else []
    if fmt == "text":
        return list(tokenizer.encode(_field(path, number, record, "text", str))) + eos, 0
    if fmt == "prompt_completion":
        prompt = list(tokenizer.encode(_field(path, number, record, "prompt", str)))
        completion = list(tokenizer.encode(_field(path, number, record, "completion", str)))
        if starts_with_added_bos(tokenizer, completion):  # it continues the prompt: no BOS between them
            completion = completion[1:]
        return prompt + completion + eos, len(prompt)
    from lucidlm.chat import encode_chat
    from lucidlm.errors import GenerationError

    messages = _field(path, number, record, "messages", list)
    if not messages or not isinstance(messages[-1], dict) or messages[-1].get("role") != "assistant":
        raise DataError(f"{path}:{number}: field \"messages\" must end with an assistant message (the answer to "
                        f"learn).")
    try:
        prompt = encode_chat(tokenizer, messages[:-1], add_generation_prompt=True)
        full = encode_chat(tokenizer, messages, add_generation_prompt=False)
    except GenerationError as exc:
        raise DataError(f"{path}:{number}: field \"messages\": {exc}") from None
    shared = 0  # the prompt is a prefix of the whole conversation, up to how the template ends it
    while shared < min(len(prompt), len(full)) and prompt[shared] == full[shared]:
        shared += 1
    return full, shared


def load_examples(path: str | Path, tokenizer: Any, length: Optional[int], max_length: int, truncate: bool = True,
                  mask_prompt: bool = False, fmt: str = "auto", pad_id: Optional[int] = None) -> Examples:
    """Read, encode, pad/truncate. ``length`` None: the longest example (at most ``max_length``,
    the model's context)."""
    path = Path(path).expanduser()
    if fmt not in FORMATS:
        raise DataError(f"example format {fmt!r}; choose one of {', '.join(FORMATS)}.")
    if not path.is_file():
        raise DataError(f"dataset {path} does not exist; pass a .jsonl file (one JSON object per line).")
    records = read_jsonl(path)
    if fmt == "auto":
        fmt = detect_format(path, records[0][1], records[0][0])
    encoded = [(number, *encode_example(path, number, record, fmt, tokenizer)) for number, record in records]
    longest = max(len(ids) for _, ids, _ in encoded)
    if length is None:
        length = min(longest, max_length)
    if not 2 <= length <= max_length:
        raise DataError(f"example length {length} must be between 2 and the model's context of {max_length} tokens.")
    if not truncate:
        for number, ids, _ in encoded:
            if len(ids) > length:
                raise DataError(f"{path}:{number}: the example has {len(ids)} tokens, more than the length of "
                                f"{length}; raise the length (--max-length, up to {max_length}) or allow truncation.")
    pad = pad_id if pad_id is not None else (getattr(tokenizer, "eos_id", None) or 0)
    ids = torch.full((len(encoded), length), pad, dtype=torch.long)  # (N, L)
    targets = torch.full((len(encoded), length), IGNORE_INDEX, dtype=torch.long)  # (N, L)
    for row, (_, tokens, n_prompt) in enumerate(encoded):
        tokens = tokens[:length]
        n = len(tokens)
        ids[row, :n] = torch.tensor(tokens)
        targets[row, : n - 1] = torch.tensor(tokens[1:n])
        if mask_prompt and n_prompt > 1:
            targets[row, : n_prompt - 1] = IGNORE_INDEX  # position t predicts token t+1, a prompt token
    return Examples(ids, targets, [len(t) for _, t, _ in encoded], [p for _, _, p in encoded], fmt)


def check_loss_tokens(examples: Examples, train_rows: torch.Tensor, val_rows: torch.Tensor, mask_prompt: bool,
                      length_flag: str, context: int) -> Optional[str]:
    """Refuse a split in which no target counts (its mean loss would be over nothing: a 0.0 that
    reads as a perfect model while nothing trains); else a warning line naming how many
    examples keep no target, or None.

    ``length_flag``: where the length came from ("--max-length" or "the model's context"), and
    ``context`` the model's. The usual cause: with ``mask_prompt`` a prompt at least as long as
    the length leaves its example no completion token; the message names the length needed."""
    length = examples.ids.shape[1]
    counted = (examples.targets != IGNORE_INDEX).sum(dim=1)  # (N,) tokens with a loss, per example
    prompts = torch.tensor(examples.prompt_lengths)  # (N,)
    cut = mask_prompt & (prompts >= length) & (torch.tensor(examples.lengths) > prompts)  # (N,) completion cut off

    def why(rows: torch.Tensor) -> str:
        """The cause and the fix for the examples ``rows`` that keep no target."""
        rows = rows[cut[rows]]
        if len(rows) == 0:
            return " (an empty completion, or a single token); give each example text to learn"
        longest = int(prompts[rows].max())
        fix = (f"raise --max-length above {longest} (the model's context is {context})" if longest < context
               else f"shorten the prompts below the model's context of {context} tokens")
        return (f": --mask-prompt skips each prompt, and the length of {length} tokens ({length_flag}) cuts off the "
                f"completion of {len(rows)} whose prompt has {'' if len(rows) == 1 else 'up to '}{longest} tokens; "
                f"{fix}, or drop --mask-prompt")

    for name, rows in (("training", train_rows), ("validation", val_rows)):
        if int(counted[rows].sum()) == 0:
            other = " (or hold out other examples: --val-fraction, --seed)" if name == "validation" else ""
            raise DataError(f"none of the {len(rows)} {name} example(s) keeps a token with a loss, so nothing would "
                            f"be {'trained' if name == 'training' else 'measured'}{why(rows)}{other}.")
    empty = torch.nonzero(counted == 0).flatten()  # examples that train nothing
    if len(empty) == 0:
        return None
    return f"warning: {len(empty)} of {len(counted)} example(s) keep no token with a loss{why(empty)}."


def split_examples(examples: Examples, val_fraction: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(train rows, val rows): a seeded shuffle, then the last ``val_fraction`` validates."""
    n = len(examples.lengths)
    n_val = max(1, round(n * val_fraction))
    if not 0.0 < val_fraction < 1.0 or n - n_val < 1:
        raise DataError(f"cannot hold out {val_fraction:.0%} of {n} example(s) for validation and keep some to "
                        f"train on; add examples or change --val-fraction (between 0 and 1).")
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    return order[: n - n_val], order[n - n_val:]
