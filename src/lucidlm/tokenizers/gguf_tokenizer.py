"""A pretrained tokenizer rebuilt from a GGUF file's metadata (``tokenizer.ggml.*``).

GGUF stores the vocabulary, the merges, which tokens are control tokens, the BOS/EOS/PAD ids
and a pre-tokenizer *name* (``smollm``, ``llama-bpe``, ``qwen2``...) standing for the regex that
cut text into chunks when the merges were learned. This module turns that into a Hugging Face
``tokenizers`` backend the way transformers does
(``transformers/integrations/gguf/gguf_tokenizer_mapping.py``), so the ids are the ones
transformers gives for the same file (byte-level BPE here; sentencepiece vocabularies in
``sentencepiece.py`` for Gemma and ``gguf_sentencepiece.py`` for Llama 2 and Mistral). Where
transformers gets a file wrong, llama.cpp decides: a role token stored outside the byte
alphabet keeps the file's id (transformers gives it a new one, past the model's vocabulary),
and an unknown pre-tokenizer name is refused (transformers splits it like GPT-2, silently).
``HFTokenizer.from_gguf_fields`` (``pretrained.py``)
calls ``tokenizer_from_gguf_fields``, handing it the class to build (this module does not
import ``pretrained.py``, which imports it).
"""

from __future__ import annotations

from itertools import compress
from typing import Any, Optional

from lucidlm.errors import TokenizerError
from lucidlm.tokenizers.gpt2_files import bytes_to_unicode
from lucidlm.validation import Fields

# llama.cpp's token_type values (llama_token_type in llama.h)
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4
# llama.cpp's end-of-generation texts (src/llama-vocab.cpp, llama_vocab::impl::load): a token
# whose text is one of these ends generation, beside the file's eos/eot/eom ids
END_OF_GENERATION_TEXTS = frozenset((
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>", "<end_of_turn>",
    "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>",
    "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>", "<｜end▁of▁sentence｜>", "[e~[",
))
# The fill-in-the-middle tokens llama.cpp also ends on, found by these texts where the file has
# no tokenizer.ggml.<kind>_token_id (Qwen's, Granite's, CodeLlama's spellings...)
FIM_TEXTS = {
    "fim_pad": frozenset(("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]")),
    "fim_rep": frozenset(("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>")),
    "fim_sep": frozenset(("<|file_sep|>",)),
}
_NAMED_TEXTS = END_OF_GENERATION_TEXTS.union(*FIM_TEXTS.values())
# tokenizer.ggml.* keys whose token plays a role: each is a special token, whatever its type
ROLE_KEYS = ("bos_token_id", "eos_token_id", "unknown_token_id", "padding_token_id", "eot_token_id", "eom_token_id")

# Pre-tokenizer regexes by GGUF ``tokenizer.ggml.pre`` name, as transformers maps them
# (``GGUF_PRE_TOKENIZER_SPLITS``); the names in GPT2_SPLIT_NAMES get GPT-2's own regex, which
# the ByteLevel pre-tokenizer applies by itself. Any other name is refused (``_split_for``).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Mistral's tekken (Mistral-Nemo): GPT-4o's letter-case split without contractions, one digit at a time
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZER_SPLITS: dict[str, str] = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                     "jina-v5-nano", "dbrx", "smaug-bpe"), _LLAMA3_SPLIT),
    "tekken": _TEKKEN_SPLIT,
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), _QWEN2_SPLIT),
    "qwen35": _QWEN35_SPLIT,
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _GPT4O_SPLIT),
}
# Names whose text is split by GPT-2's regex: llama.cpp's "default" and GPT-2 types, "gpt2" as
# GGUF writers spell it, and the vocabularies that split each digit first (smollm, starcoder...):
# their merges never join a digit to anything, so GPT-2's regex gives the same ids, and
# transformers reads them with it too. An empty name is a file with no tokenizer.ggml.pre.
GPT2_SPLIT_NAMES = frozenset((
    "", "default", "gpt2", "gpt-2", "phi-2", "jina-es", "jina-de", "jina-v1-en", "jina-v2-es", "jina-v2-de",
    "jina-v2-code", "roberta-bpe", "gigachat", "a.x-4.0", "mellum", "exaone4", "mpt", "olmo", "jais", "trillion",
    "smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b",
))


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
    # the role tokens' ids (a bad one is refused by id_for below, when its role is read)
    role_ids = {i for i in (fields.get(f"tokenizer.ggml.{key}") for key in ROLE_KEYS)
                if type(i) is int and 0 <= i < len(tokens)}
    if kind == "gpt2":
        split = _split_for(fields, source)
        backend, vocab = _byte_level_backend(tokens, merges, source, keep_literal=role_ids)
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
    elif kind == "llama":  # Llama 2, TinyLlama, Mistral 7B...
        from lucidlm.tokenizers.gguf_sentencepiece import llama_backend

        scores: list[float] = checked.list("tokenizer.ggml.scores", item=float)
        if len(scores) != len(tokens):
            raise TokenizerError(f"{source}: tokenizer.ggml.scores has {len(scores)} entries for {len(tokens)} "
                                 f"tokens; the file is corrupted. Convert the model again.")
        backend, vocab = llama_backend(tokens, scores, _merge_pairs(merges, source) if merges else None)
        alphabet = None
    else:
        raise TokenizerError(
            f"{source}: tokenizer.ggml.model={kind!r} (architecture {arch!r}) is not supported; lucidlm "
            f"builds byte-level BPE ('gpt2') and sentencepiece ('llama') tokenizers from GGUF metadata, "
            f"and cannot load this file."
        )

    # A "control" token outside the byte alphabet is a llama.cpp mislabel (transformers skips it too),
    # unless it holds a role: the BOS of a DeepSeek-R1 distill is "<｜begin▁of▁sentence｜>", kept
    # under that text in the vocabulary (keep_literal), at the file's id, as llama.cpp reads it.
    # Role tokens are special whatever their type, as transformers adds them.
    control = [t for i, (t, kind_) in enumerate(zip(tokens, types))
               if (kind_ == TOKEN_TYPE_CONTROL and (alphabet is None or set(t) <= alphabet)) or i in role_ids]
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
    # the end-of-turn / end-of-message ids chat models declare (Llama 3's <|eot_id|>, <|eom_id|>),
    # and the tokens llama.cpp recognises by their text (end_of_generation_ids).
    end_ids = [id_for(key) for key in ("eos_token_id", "eot_token_id", "eom_token_id")]
    fim_ids = {kind: id_for(f"{kind}_token_id") for kind in FIM_TEXTS}
    eos_ids = end_of_generation_ids(tokens, [i for i in end_ids if i is not None], fim_ids)

    template = fields.get("tokenizer.chat_template")
    if template is not None and not isinstance(template, str):
        raise TokenizerError(f"{source}: tokenizer.chat_template is {type(template).__name__}, not a string; "
                             f"the file is corrupted. Convert the model again.")
    # llama.cpp (and transformers) put BOS before sentencepiece text whose file does not say otherwise
    tokenizer = cls(backend, add_bos=checked.bool("tokenizer.ggml.add_bos_token", default=kind == "llama"),
                    bos_token=token_for("bos_token_id"), eos_token=token_for("eos_token_id"),
                    pad_token=token_for("padding_token_id"), unk_token=token_for("unknown_token_id"),
                    chat_template=template, eos_ids=eos_ids)
    tokenizer.chat_template_source = f"{source} (tokenizer.chat_template)"
    tokenizer.source = source
    # encode() never appends it, as for a Hugging Face tokenizer whose post-processor would
    # (hf_files.py): what lucidlm encodes is a prompt, which goes on.
    tokenizer.add_eos = checked.bool("tokenizer.ggml.add_eos_token", default=False)
    return tokenizer


def end_of_generation_ids(tokens: list[str], declared: list[int], fim_ids: dict[str, Optional[int]]) -> list[int]:
    """The ids llama.cpp ends generation on (its ``special_eog_ids``, built when it loads a
    vocabulary): ``declared`` (the file's eos/eot/eom ids) first, then by id the tokens whose
    text is in END_OF_GENERATION_TEXTS, whatever their type (llama.cpp marks them control), and
    the fill-in-the-middle pad/repo/separator tokens (``fim_ids``: the file's ids, None where it
    names none: then the token with one of FIM_TEXTS' texts). Files seldom declare an eot id, so
    the text is what makes SmolLM2 stop on <|endoftext|> and Gemma 3 on <end_of_turn>."""
    named = list(compress(range(len(tokens)), map(_NAMED_TEXTS.__contains__, tokens)))  # one C-level pass
    kept = {i for i in named if tokens[i] in END_OF_GENERATION_TEXTS}
    for kind, token_id in fim_ids.items():
        if token_id is None:  # llama.cpp takes whichever its hash map yields first; here the lowest id
            token_id = next((i for i in named if tokens[i] in FIM_TEXTS[kind]), None)
        if token_id is not None:
            kept.add(token_id)
    kept.update(declared)
    texts = {tokens[i]: i for i in sorted(kept, reverse=True)}  # a text twice: its lowest id
    # Two texts stop being ends in vocabularies where they mean something else: <|end|> closes a
    # message before a tool call in gpt-oss's harmony format (and solar-open's), and </s> is an
    # HTML tag in Gemma 4's vocabulary.
    if "<|end|>" in texts and texts.keys() & {"<|call|>", "<|calls|>"} and texts.keys() & {"<|return|>", "<|flush|>"}:
        kept.discard(texts["<|end|>"])
    if "</s>" in texts and "<|tool_response>" in texts:
        kept.discard(texts["</s>"])
    return list(dict.fromkeys([i for i in declared if i in kept] + sorted(kept)))


def _split_for(fields: dict[str, Any], source: str) -> Optional[str]:
    """The regex ``tokenizer.ggml.pre`` names, None for GPT-2's own; an unknown name is refused:
    splitting with a guess would give other ids than the model was trained on, silently."""
    name = fields.get("tokenizer.ggml.pre", "")
    if name in PRE_TOKENIZER_SPLITS:
        return PRE_TOKENIZER_SPLITS[name]
    if name in GPT2_SPLIT_NAMES:
        return None
    raise TokenizerError(
        f"{source}: tokenizer.ggml.pre={name!r} names a pre-tokenizer (the regex that cuts text before the merges) "
        f"lucidlm does not know, so it cannot give this model's token ids (llama.cpp refuses unknown names too; "
        f"lucidlm knows {', '.join(sorted(PRE_TOKENIZER_SPLITS))}, and gpt-2, default, smollm and the others "
        f"split by GPT-2's regex). Load the model from its Hugging Face directory (with its tokenizer.json) instead.")


def _merge_pairs(merges: list[str], source: str) -> list[tuple[str, str]]:
    """``tokenizer.ggml.merges`` ("a b" strings) as (left, right) pairs, checked."""
    pairs = [tuple(m.split(" ")) for m in merges]
    if list(map(len, pairs)).count(2) != len(pairs) or not all(map(all, pairs)):  # two non-empty parts each
        index = next(i for i, pair in enumerate(pairs) if len(pair) != 2 or not all(pair))
        raise TokenizerError(f"{source}: tokenizer.ggml.merges[{index}] is {merges[index][:60]!r}, not two tokens "
                             f"separated by one space; the file is corrupted. Convert the model again.")
    return pairs  # type: ignore[return-value]  (two parts each, checked above)


def _byte_level_backend(tokens: list[str], merges: list[str], source: str,
                        keep_literal: frozenset[int] | set[int] = frozenset()) -> tuple[Any, dict[str, int]]:
    """A BPE backend over GPT-2's byte alphabet (no pre-tokenizer or decoder yet). Tokens
    stored in plain UTF-8 are respelled in the alphabet, except those of ids in
    ``keep_literal`` (role tokens: they are matched whole, as added tokens, by their text)."""
    from tokenizers import Tokenizer as Backend
    from tokenizers.models import BPE

    # The loops below run over ~50k tokens and merges in a fresh process before its first token,
    # so they are written as C-level passes (join, zip, map) where one would do.
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    spelled = tokens
    if not set("".join(tokens)) <= alphabet:  # some token, e.g. a control token, is stored in plain UTF-8:
        # BPE looks tokens up in byte spelling
        spelled = [t if set(t) <= alphabet or i in keep_literal else "".join(spelling[b] for b in t.encode("utf-8"))
                   for i, t in enumerate(tokens)]
    # a spelling listed twice keeps its first id: reversed, the first id is the last one written
    vocab = dict(zip(reversed(spelled), range(len(spelled) - 1, -1, -1)))
    pairs = _merge_pairs(merges, source)
    try:
        backend = Backend(BPE(vocab=vocab, merges=pairs, dropout=None, continuing_subword_prefix="",
                              end_of_word_suffix="", fuse_unk=False))
    except Exception as exc:  # the Rust side rejects merges naming unknown tokens
        detail = " ".join(str(exc).split())[:160]
        raise TokenizerError(f"{source}: the vocabulary and merges do not form a BPE tokenizer ({detail}).") from None
    return backend, vocab


__all__ = ["END_OF_GENERATION_TEXTS", "FIM_TEXTS", "GPT2_SPLIT_NAMES", "PRE_TOKENIZER_SPLITS", "ROLE_KEYS",
           "TOKEN_TYPE_CONTROL", "TOKEN_TYPE_USER_DEFINED", "end_of_generation_ids", "tokenizer_from_gguf_fields"]
