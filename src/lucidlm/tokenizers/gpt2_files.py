"""OpenAI's GPT-2 tokenizer files (``encoder.json`` + ``vocab.bpe``) -> a merge list for ``BPETokenizer``.

In those files tokens are written through ``bytes_to_unicode`` (a space is "Ġ"); ``vocab.bpe``
lists the merges in rank order after a ``#version`` line. The same byte spelling is used by
Hugging Face ``tokenizer.json`` and GGUF byte-level vocabularies, which is why
``pretrained.py`` and ``gguf_tokenizer.py`` read ``bytes_to_unicode`` from here too.
"""

from __future__ import annotations

import json
from pathlib import Path

from lucidlm.errors import TokenizerError
from lucidlm.tokenizers.bpe_trainer import Pair

ENDOFTEXT = "<|endoftext|>"

# GPT-2's pre-tokenizer (openai/gpt-2 encoder.py). \p{L} letters, \p{N} numbers; the
# "\s+(?!\S)" branch leaves the last space of a run to start the next word (" dog").
GPT2_SPLIT_PATTERN = (
    r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, used by its ``encoder.json``/``vocab.bpe``.

    Printable Latin-1 bytes map to themselves; the other 68 (control bytes, space, ...)
    map to chr(256), chr(257), ... in byte order. That is why a leading space shows as "Ġ"
    (chr(256 + 32)) in GPT-2's files.
    """
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def read_gpt2_files(encoder_json: str | Path, vocab_bpe: str | Path) -> tuple[list[Pair], dict[str, int], list[int]]:
    """(merges, special tokens, byte_order) from ``encoder.json`` and ``vocab.bpe``, checked to agree:
    ids 0..255 are the single bytes and merge ``r`` makes id ``256 + r``."""
    for path in (encoder_json, vocab_bpe):
        if not Path(path).is_file():
            raise TokenizerError(f"GPT-2 tokenizer file {path} does not exist")
    encoder: dict[str, int] = json.loads(Path(encoder_json).read_text(encoding="utf-8"))
    lines = Path(vocab_bpe).read_text(encoding="utf-8").split("\n")
    if lines and lines[0].startswith("#version"):
        lines = lines[1:]
    merge_lines = [line for line in lines if line.strip()]

    byte_decoder = {ch: b for b, ch in bytes_to_unicode().items()}
    # ids 0..255 must be the single bytes: that is what makes "id = 256 + rank" hold
    try:
        id_to_token = {i: tok for tok, i in encoder.items()}
        byte_order = [byte_decoder[id_to_token[i]] for i in range(256)]
    except KeyError as err:
        raise TokenizerError(
            f"{encoder_json}: ids 0..255 are not GPT-2's 256 single-byte tokens ({err})"
        ) from err

    merges: list[Pair] = []
    for rank, line in enumerate(merge_lines):
        left, right = line.split(" ")
        try:
            pair = (encoder[left], encoder[right])
            made = encoder[left + right]
        except KeyError as err:
            raise TokenizerError(
                f"{vocab_bpe} line {rank + 2} ({line!r}) uses token {err} that is not in "
                f"{encoder_json}; are the two files from the same model?"
            ) from None
        if made != 256 + rank:
            raise TokenizerError(
                f"{vocab_bpe} line {rank + 2}: merge {line!r} makes id {made} in "
                f"{encoder_json}, expected {256 + rank}; the files do not match"
            )
        merges.append(pair)

    specials = {tok: i for tok, i in encoder.items() if i >= 256 + len(merges)}
    if ENDOFTEXT not in specials:
        raise TokenizerError(f"{encoder_json} has no {ENDOFTEXT!r} after the merges")
    return merges, specials, byte_order
