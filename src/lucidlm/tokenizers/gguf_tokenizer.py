"""A pretrained tokenizer rebuilt from a GGUF file's metadata (``tokenizer.ggml.*``).

GGUF stores the vocabulary, the merges, which tokens are control tokens, the BOS/EOS/PAD ids
and a pre-tokenizer *name* (``smollm``, ``llama-bpe``, ``qwen2``...) standing for the regex that
cut text into chunks when the merges were learned. This module turns that into a Hugging Face
``tokenizers`` backend the way transformers does
(``transformers/integrations/gguf/gguf_tokenizer_mapping.py``), so the ids are the ones
transformers gives for the same file. ``HFTokenizer.from_gguf_fields`` (``pretrained.py``)
calls ``tokenizer_from_gguf_fields``, handing it the class to build (this module does not
import ``pretrained.py``, which imports it).
"""

from __future__ import annotations

from typing import Any, Optional

from lucidlm.errors import TokenizerError
from lucidlm.tokenizers.gpt2_files import bytes_to_unicode
from lucidlm.validation import Fields

# llama.cpp's token_type values (llama_token_type in llama.h)
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4

# Pre-tokenizer regexes by GGUF ``tokenizer.ggml.pre`` name, as transformers maps them.
# Names not listed (``gpt2``, ``smollm``, ``default``...) get GPT-2's own regex, which is
# what the ByteLevel pre-tokenizer applies by itself.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZER_SPLITS: dict[str, str] = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "dbrx", "smaug-bpe", "pixtral"), _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _QWEN2_SPLIT),
    **dict.fromkeys(("gpt-4o", "llama4"), _GPT4O_SPLIT),
}


def tokenizer_from_gguf_fields(cls: Any, fields: dict[str, Any], source: str = "GGUF file") -> Any:
    """An ``HFTokenizer`` (``cls``) built from GGUF metadata (``tokenizer.ggml.*`` keys, decoded
    to Python values); ``HFTokenizer.from_gguf_fields`` calls this."""
    from tokenizers import AddedToken, Regex, decoders, pre_tokenizers

    checked = Fields(fields, source, TokenizerError, fix="the file's tokenizer metadata is corrupted; convert "
                                                         "the model again")
    kind = fields.get("tokenizer.ggml.model")
    arch = str(fields.get("general.architecture", ""))
    tokens: list[str] = checked.list("tokenizer.ggml.tokens", default=[], item=str)
    merges: list[str] = checked.list("tokenizer.ggml.merges", default=[], item=str)
    types: list[int] = checked.list("tokenizer.ggml.token_type", default=[1] * len(tokens), item=int)
    if len(types) != len(tokens):
        raise TokenizerError(f"{source}: tokenizer.ggml.token_type has {len(types)} entries for "
                             f"{len(tokens)} tokens; the file is corrupted. Convert the model again.")
    if not tokens:
        raise TokenizerError(f"{source}: tokenizer.ggml.tokens is missing or empty; the file has no tokenizer.")
    if kind == "gpt2":
        backend, vocab = _byte_level_backend(tokens, merges, source)
        split = PRE_TOKENIZER_SPLITS.get(fields.get("tokenizer.ggml.pre", ""))
        if split is None:
            backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        else:
            backend.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ])
        backend.decoder = decoders.ByteLevel()
        alphabet = set(bytes_to_unicode().values())
    elif kind == "llama" and arch.startswith("gemma"):
        from lucidlm.tokenizers.sentencepiece import gemma_backend

        backend, vocab = gemma_backend(tokens)
        alphabet = None  # every token is a real one: no byte-alphabet check for control tokens
    else:
        raise TokenizerError(
            f"{source}: tokenizer.ggml.model={kind!r} (architecture {arch!r}) is not supported; lucidlm "
            f"builds byte-level BPE ('gpt2') tokenizers and Gemma's sentencepiece ('llama' in a gemma "
            f"file) from GGUF metadata. Load the model's tokenizer.json with HFTokenizer.from_file instead."
        )

    # A "control" token outside the byte alphabet is a llama.cpp mislabel (transformers skips it too).
    control = [t for t, kind_ in zip(tokens, types)
               if kind_ == TOKEN_TYPE_CONTROL and (alphabet is None or set(t) <= alphabet)]
    user = [t for t, kind_ in zip(tokens, types) if kind_ == TOKEN_TYPE_USER_DEFINED and t in vocab]
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in control])
    backend.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])

    def id_for(key: str) -> Optional[int]:
        token_id = checked.int(f"tokenizer.ggml.{key}", default=None)
        if token_id is None:
            return None
        if not 0 <= int(token_id) < len(tokens):
            raise TokenizerError(f"{source}: tokenizer.ggml.{key}={token_id} is outside the vocabulary "
                                 f"of {len(tokens)} tokens.")
        return int(token_id)

    def token_for(key: str) -> Optional[str]:
        token_id = id_for(key)
        return None if token_id is None else tokens[token_id]

    # Generation ends on any end-of-generation token, as llama.cpp's llama_vocab_is_eog: the EOS,
    # and the end-of-turn / end-of-message ids chat models declare (Llama 3's <|eot_id|>, <|eom_id|>).
    end_ids = [id_for(key) for key in ("eos_token_id", "eot_token_id", "eom_token_id")]
    eos_ids = list(dict.fromkeys(i for i in end_ids if i is not None))

    template = fields.get("tokenizer.chat_template")
    if template is not None and not isinstance(template, str):
        raise TokenizerError(f"{source}: tokenizer.chat_template is {type(template).__name__}, not a string; "
                             f"the file is corrupted. Convert the model again.")
    tokenizer = cls(backend, add_bos=checked.bool("tokenizer.ggml.add_bos_token", default=False),
                    bos_token=token_for("bos_token_id"), eos_token=token_for("eos_token_id"),
                    pad_token=token_for("padding_token_id"), unk_token=token_for("unknown_token_id"),
                    chat_template=template, eos_ids=eos_ids)
    tokenizer.chat_template_source = f"{source} (tokenizer.chat_template)"
    tokenizer.source = source
    return tokenizer


def _byte_level_backend(tokens: list[str], merges: list[str], source: str) -> tuple[Any, dict[str, int]]:
    """A BPE backend over GPT-2's byte alphabet (no pre-tokenizer or decoder yet)."""
    from tokenizers import Tokenizer as Backend
    from tokenizers.models import BPE

    # The loops below run over ~50k tokens and merges in a fresh process before its first token,
    # so they are written as C-level passes (join, zip, map) where one would do.
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    spelled = tokens
    if not set("".join(tokens)) <= alphabet:  # some token, e.g. a control token, is stored in plain UTF-8:
        # BPE looks tokens up in byte spelling
        spelled = [t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")) for t in tokens]
    # a spelling listed twice keeps its first id: reversed, the first id is the last one written
    vocab = dict(zip(reversed(spelled), range(len(spelled) - 1, -1, -1)))
    pairs = [tuple(m.split(" ")) for m in merges]
    if list(map(len, pairs)).count(2) != len(pairs) or not all(map(all, pairs)):  # two non-empty parts each
        index = next(i for i, pair in enumerate(pairs) if len(pair) != 2 or not all(pair))
        raise TokenizerError(f"{source}: tokenizer.ggml.merges[{index}] is {merges[index][:60]!r}, not two tokens "
                             f"separated by one space; the file is corrupted. Convert the model again.")
    try:
        backend = Backend(BPE(vocab=vocab, merges=pairs, dropout=None, continuing_subword_prefix="",
                              end_of_word_suffix="", fuse_unk=False))
    except Exception as exc:  # the Rust side rejects merges naming unknown tokens
        detail = " ".join(str(exc).split())[:160]
        raise TokenizerError(f"{source}: the vocabulary and merges do not form a BPE tokenizer ({detail}).") from None
    return backend, vocab


__all__ = ["PRE_TOKENIZER_SPLITS", "TOKEN_TYPE_CONTROL", "TOKEN_TYPE_USER_DEFINED", "tokenizer_from_gguf_fields"]
