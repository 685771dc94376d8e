"""A ``BPETokenizer`` as a Hugging Face ``tokenizer.json``, for ``save_hf`` / ``convert --to hf``.

lucidlm's byte-level BPE maps onto Hugging Face's pieces one to one: a ``BPE`` model whose
vocabulary is spelled in GPT-2's byte alphabet (``bytes_to_unicode``) with the merges in rank
order, a ``ByteLevel`` pre-tokenizer (GPT-2's regex, or first a ``Split`` on the tokenizer's own
pattern) and decoder, and the special tokens as added tokens in id order.

Some tokenizers cannot be mirrored (two merges making the same bytes, a special token spelled
like an ordinary one, a pattern Hugging Face's regex engine reads differently): the export
says why with a TokenizerError rather than write a file that encodes other ids. The written
JSON is read back with ``tokenizers`` and run on probe texts, so such a difference is caught
here, not by a user.
"""

from __future__ import annotations

import json
from typing import Any

from lucidlm.errors import TokenizerError
from lucidlm.tokenizers.gpt2_files import GPT2_SPLIT_PATTERN, bytes_to_unicode
from lucidlm.tokenizers.regex_safety import nested_quantifier

# What an export is checked on against Hugging Face: words, contractions, digits, punctuation,
# whitespace runs, accents, CJK, emoji, and each special token (the first 64) in text.
_PROBE_TEXT = "Hello, world! It's 2024: I'LL pay $3.50 for 12345 café\n\n\t  naïve 日本語 🦊🦊 <a>   end.  "
_PROBED_SPECIALS = 64


def bpe_to_hf_json(tokenizer: Any) -> str:
    """The tokenizer.json text of a ``BPETokenizer``; TokenizerError naming why it cannot be one."""
    from tokenizers import Tokenizer as Backend  # local: only the export needs the Rust library

    to_char = bytes_to_unicode()
    n_mergeable = 256 + len(tokenizer.merges)
    spelled = [to_char[byte] for byte in tokenizer.byte_order]  # id -> token in GPT-2's byte alphabet
    spelled += [""] * len(tokenizer.merges)
    for new_id, (left, right) in enumerate(tokenizer.merges, start=256):
        spelled[new_id] = spelled[left] + spelled[right]
    vocab = {piece: token_id for token_id, piece in enumerate(spelled)}
    if len(vocab) < n_mergeable:
        _refuse("two of its merges make the same bytes, and a Hugging Face vocabulary holds each once")
    specials = sorted(tokenizer.special_tokens, key=tokenizer.special_tokens.__getitem__)
    from_char = {char: byte for byte, char in to_char.items()}
    for name in specials:
        if name in vocab:  # Hugging Face would give the special token that token's id
            _refuse(f"special token {name!r} is spelled like its ordinary token {vocab[name]}")
        if all(c in from_char for c in name) and bytes(from_char[c] for c in name) != name.encode("utf-8",
                                                                                                 "surrogatepass"):
            _refuse(f"Hugging Face's ByteLevel decoder would read special token {name!r} as GPT-2 byte "
                    f"characters and decode it to other text")
    nested = nested_quantifier(tokenizer.pattern) if tokenizer.pattern != GPT2_SPLIT_PATTERN else None
    if nested:
        _refuse(f"its pattern repeats {nested}, which lucidlm refuses to load from a tokenizer.json")
    merges = [(spelled[a], spelled[b]) for a, b in tokenizer.merges]
    text = json.dumps(_tokenizer_spec(tokenizer.pattern, vocab, merges, specials, n_mergeable), ensure_ascii=False)
    try:
        backend = Backend.from_str(text)
        for probe in [_PROBE_TEXT] + [f"a{name} {name}b" for name in specials[:_PROBED_SPECIALS]]:
            ids = backend.encode(probe, add_special_tokens=False).ids
            if ids != tokenizer.encode(probe) or backend.decode(ids, skip_special_tokens=False) != tokenizer.decode(ids):
                _refuse(f"Hugging Face encodes or decodes {probe[:40]!r} differently (its regex engine, Oniguruma, "
                        f"reads the pattern another way)")
    except TokenizerError:
        raise
    except BaseException as exc:  # the Rust backend's PanicException derives from BaseException
        if not isinstance(exc, Exception) and type(exc).__name__ != "PanicException":
            raise
        _refuse(f"Hugging Face's tokenizers library cannot run it ({' '.join(str(exc).split())[:120]})")
    return text


def _refuse(problem: str) -> None:
    raise TokenizerError(f"this BPE tokenizer cannot be written as a Hugging Face tokenizer.json: {problem}. "
                         f"Keep it in lucidlm's own format with tokenizer.save(path).")


def _tokenizer_spec(pattern: str, vocab: dict[str, int], merges: list[tuple[str, str]],
                    specials: list[str], first_special_id: int) -> dict[str, Any]:
    """A Hugging Face tokenizer.json for byte-level BPE; tokens spelled in GPT-2's byte alphabet."""
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    if pattern == GPT2_SPLIT_PATTERN:
        pre_tokenizer = byte_level  # its regex is GPT-2's, as in GPT-2's own tokenizer.json
    else:
        # Removed + invert: each whole match is a chunk and text no match covers is dropped, as
        # split_chunks does ("Isolated" would keep that text as chunks of its own).
        split = {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Removed", "invert": True}
        pre_tokenizer = {"type": "Sequence", "pretokenizers": [split, dict(byte_level, use_regex=False)]}
    # Added tokens take the ids after the model's vocabulary in list order (tokenizers assigns
    # them on load), which is where lucidlm puts its special tokens.
    added = [{"id": first_special_id + i, "content": name, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": True} for i, name in enumerate(specials)]
    model = {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
             "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
             "vocab": vocab, "merges": [f"{left} {right}" for left, right in merges]}  # no space in the alphabet
    return {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
            "pre_tokenizer": pre_tokenizer, "post_processor": None,
            "decoder": dict(byte_level, add_prefix_space=True), "model": model}
