"""Tokenizers of pretrained models, run by the Hugging Face ``tokenizers`` library.

A pretrained model's ids only mean something under its own tokenizer, byte for byte. Two
places describe one:

- a GGUF file's metadata (``tokenizer.ggml.*``): the vocabulary, the merges, which tokens
  are control tokens, the BOS/EOS/PAD ids, and a pre-tokenizer *name* (``smollm``,
  ``llama-bpe``, ``qwen2``...) standing for the regex that cut text into chunks when the
  merges were learned;
- a Hugging Face ``tokenizer.json``, which spells all of that out.

``HFTokenizer.from_gguf_fields`` rebuilds the first the way transformers does
(``transformers/integrations/gguf/gguf_tokenizer_mapping.py``), so the ids are the ones
transformers gives for the same file; ``HFTokenizer.from_file`` reads the second. Building
the backend from each source lives in its own module (``gguf_tokenizer.py``, ``hf_files.py``);
this one holds the tokenizer itself: encoding, decoding to bytes, and saving.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from lucidlm.errors import TokenizerError
from lucidlm.tokenizers.base import Tokenizer
from lucidlm.tokenizers.encode_input import AllowedSpecial, check_text
from lucidlm.tokenizers.gpt2_files import bytes_to_unicode
from lucidlm.tokenizers.gguf_tokenizer import (  # noqa: F401  (re-exported: this module was their home)
    PRE_TOKENIZER_SPLITS, TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED, tokenizer_from_gguf_fields)
from lucidlm.tokenizers.hf_decoder import plan_decoder
from lucidlm.tokenizers.hf_files import tokenizer_from_file, with_bos_post_processor
from lucidlm.tokenizers import long_text
from lucidlm.tokenizers.regex_safety import check_backend_regexes
from lucidlm.validation import Fields

if TYPE_CHECKING:  # for the hints only: importing the Rust library is the loaders' job
    import tokenizers

_BYTE_DECODER = {char: byte for byte, char in bytes_to_unicode().items()}

# Backends rebuilt for a strict subset of allowed special tokens, most recent kept. Each is a full
# copy (Gemma 3's: ~80 MB, 6-10 s to build), so a caller cycling through many subsets must not keep
# them all; two still serve one alternating between two subsets (e.g. {bos} and {eos}).
SUBSET_BACKENDS_KEPT = 2


class HFTokenizer(Tokenizer):
    """lucidlm's Tokenizer interface over a ``tokenizers.Tokenizer``.

    ``add_bos``: whether ``encode`` puts the BOS id first (the GGUF's ``add_bos_token``).
    ``chat_template``: the Jinja chat template that came with the model, or None.
    ``eos_ids``: every id generation stops on (a GGUF's eos/eot/eom ids, a Hugging Face
    ``generation_config.json``'s ``eos_token_id`` list); by default the EOS role's id alone.
    """

    type_name = "hf"

    def __init__(self, backend: tokenizers.Tokenizer, *, add_bos: bool = False, bos_token: Optional[str] = None,
                 eos_token: Optional[str] = None, pad_token: Optional[str] = None,
                 unk_token: Optional[str] = None, chat_template: Optional[str] = None,
                 eos_ids: Optional[Sequence[int]] = None, source: Optional[str] = None) -> None:
        # A tokenizer.json may carry a truncation or padding setting (a classifier's 512): the
        # backend would then cut a prompt short or pad it with no error. transformers encodes
        # without them unless asked; so does lucidlm, whose prompts are checked against the context.
        if backend.truncation is not None:
            backend.no_truncation()
        if backend.padding is not None:
            backend.no_padding()
        self._backend = backend
        self.add_bos = add_bos
        # Whether the model's sequences end with EOS (a GGUF's add_eos_token). encode() never
        # appends it: what lucidlm encodes is a prompt, which goes on.
        self.add_eos = False
        self.unk_token = unk_token
        self.chat_template = chat_template
        self.chat_template_source: Optional[str] = None  # "file (key)", named by chat-template errors
        self.source = source  # the file it was read from, named by errors
        added = backend.get_added_tokens_decoder()  # id -> AddedToken
        special = {tok.content: i for i, tok in added.items() if tok.special}
        unflagged_added = {tok.content for tok in added.values() if not tok.special}
        for role in (bos_token, eos_token, pad_token):  # a role token is special even if unflagged
            if role is not None and role not in special:
                role_id = backend.token_to_id(role)
                if role_id is None:
                    raise TokenizerError(f"special token {role!r} is not in the vocabulary")
                special[role] = role_id
        super().__init__(special, bos_token=bos_token, eos_token=eos_token, pad_token=pad_token)
        self._vocab_size = backend.get_vocab_size(with_added_tokens=True)
        default_eos = [] if self.eos_id is None else [self.eos_id]
        self.eos_ids: list[int] = [int(i) for i in eos_ids] if eos_ids else default_eos  # generation stops on any
        self._decoder = plan_decoder(backend, self.source or "the tokenizer")  # refuses decoders it cannot mirror
        # The backend's encode_special_tokens switch makes every added token flagged special plain
        # text, which is allowed_special=False exactly unless a role token is an added token *not*
        # flagged special (the switch would leave that one whole).
        self._switch_splits_specials = not unflagged_added & special.keys()
        # Held by every encode through self._backend: allowed_special=False flips its switch for the
        # call, and the backend encodes with the GIL released, so another thread's encode would see
        # the flip. Also guards _subsets (never held while a subset backend is built).
        self._lock = threading.Lock()
        self._subsets: dict[frozenset[str], Any] = {}  # allowed special tokens -> backend, oldest first
        self._bytes: dict[int, bytes] = {}  # id -> bytes, each built when first decoded
        self._added: Optional[dict[int, Any]] = None  # the backend's added tokens, read on first decode
        self._cuts_safely: Optional[bool] = None  # whether long texts may go in pieces, read on first need

    # ----------------------------------------------------------------- constructors

    @classmethod
    def from_gguf_fields(cls, fields: dict[str, Any], source: str = "GGUF file") -> "HFTokenizer":
        """Build from GGUF metadata (``tokenizer.ggml.*`` keys, decoded to Python values); see
        ``gguf_tokenizer.py``."""
        return tokenizer_from_gguf_fields(cls, fields, source)

    @classmethod
    def from_file(cls, path: str | Path, config_path: Optional[str | Path] = None) -> "HFTokenizer":
        """Read a Hugging Face ``tokenizer.json``. Roles (bos/eos/pad), add_bos and the chat
        template come from ``tokenizer_config.json`` beside it (or ``config_path``) if present;
        see ``hf_files.py``."""
        return tokenizer_from_file(cls, path, config_path)

    # ----------------------------------------------------------------- Tokenizer interface

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def encode(self, text: str, *, allowed_special: AllowedSpecial = True) -> list[int]:
        """Text -> ids, with the BOS id first when the model's tokenizer adds one."""
        check_text(text)
        ids = self._encode_allowing(text, frozenset(self._allowed_special_set(allowed_special)))
        if self.add_bos and self.bos_id is not None:
            ids = [self.bos_id, *ids]
        return ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Many texts at once (in parallel in the Rust backend); special tokens allowed."""
        texts = list(texts)
        for text in texts:
            check_text(text)
        with self._lock:
            encoded = self._guarded(lambda: self._backend.encode_batch(texts, add_special_tokens=False))
        prefix = [self.bos_id] if self.add_bos and self.bos_id is not None else []
        return [prefix + e.ids for e in encoded]

    def _encode_ordinary(self, text: str, offset: int) -> list[int]:
        return self._encode_allowing(text, frozenset())

    def _encode_allowing(self, text: str, allowed: frozenset[str]) -> list[int]:
        """``text``'s ids, the special tokens in ``allowed`` (a subset of ``special_tokens``)
        being their own id and the others ordinary text. One backend call encodes the whole
        text, the allowed tokens keeping their own flags (lstrip, rstrip, single_word) and the
        text around them its sentencepiece prefix only at the start, as transformers does.
        Added tokens that are not special (Gemma's <h1>, runs of newlines) stay whole either
        way: they are how the model writes that text (transformers' split_special_tokens=True
        keeps them too)."""
        if len(allowed) == len(self.special_tokens):  # all of them
            with self._lock:
                return self._guarded(lambda: self._ids(self._backend, text))
        if not allowed and self._switch_splits_specials:
            # the backend's own switch (what split_special_tokens=True sets): no copy of it
            with self._lock:
                before = self._backend.encode_special_tokens
                self._backend.encode_special_tokens = True
                try:
                    return self._guarded(lambda: self._ids(self._backend, text))
                finally:
                    self._backend.encode_special_tokens = before
        backend = self._backend_allowing(allowed)
        return self._guarded(lambda: self._ids(backend, text))

    def _ids(self, backend: Any, text: str) -> list[int]:
        """``backend``'s ids for ``text``; a long text a piece at a time where the pieces give the
        same ids (``long_text.py``: one call held ~135 bytes per byte of text)."""
        if len(text) > long_text.LONG_TEXT_CHARS:
            if self._cuts_safely is None:  # read once: a subset backend differs only in fewer added tokens
                self._cuts_safely = long_text.cuts_safely(self._backend)
            if self._cuts_safely:
                return long_text.encode_in_pieces(backend, text)
        return backend.encode(text, add_special_tokens=False).ids

    def _backend_allowing(self, allowed: frozenset[str]) -> Any:
        """A copy of the backend less the special tokens not in ``allowed``, so that those
        strings stay ordinary text: the backend's switch turns all of them into text or none.
        The last ``SUBSET_BACKENDS_KEPT`` are kept; never the whole backend (use it directly)."""
        with self._lock:
            backend = self._subsets.pop(allowed, None)
            if backend is not None:
                self._subsets[allowed] = backend  # now the most recent
                return backend
        from tokenizers import Tokenizer as Backend

        removed = set(self.special_tokens) - allowed
        spec = json.loads(self._backend.to_str())
        spec["added_tokens"] = [t for t in spec["added_tokens"] if t["content"] not in removed]
        backend = Backend.from_str(json.dumps(spec))  # seconds for a large vocabulary: built unlocked
        with self._lock:
            self._subsets[allowed] = backend
            while len(self._subsets) > SUBSET_BACKENDS_KEPT:
                del self._subsets[next(iter(self._subsets))]  # the least recently used
        return backend

    def _guarded(self, run: Any) -> Any:
        """``run()``, with a panic of the Rust backend (Oniguruma's retry limit on a regex that
        backtracks catastrophically, which ``check_backend_regexes`` cannot always foresee)
        turned into one TokenizerError instead of a PanicException traceback."""
        try:
            return run()
        except BaseException as exc:  # PanicException derives from BaseException, not Exception
            if type(exc).__name__ != "PanicException":
                raise
            where = self.source or "the tokenizer"
            raise TokenizerError(f"{where}: the tokenizer's regexes failed on this text ("
                                 f"{' '.join(str(exc).split())[:120]}); its pre-tokenizer backtracks too much. "
                                 f"Use the model's original tokenizer.json.") from None

    def _token_bytes(self, token_id: int) -> bytes:
        # One token at a time: spelling out all 49k tokens up front cost a streamed
        # generation ~0.3 s before its first token.
        piece = self._bytes.get(token_id)
        if piece is None:
            if self._added is None:
                self._added = self._backend.get_added_tokens_decoder()
            piece = self._bytes[token_id] = self._piece_bytes(token_id, self._added)
        return piece

    def _spells_out_text(self) -> bool:
        """Byte-level BPE that keeps every byte: no normalizer (NFC, lowercasing, stripping
        rewrite text), pre-tokenizers that split without dropping (ByteLevel, Split but not its
        "Removed"), no fused unknown runs, no added token that takes the spaces around it."""
        if getattr(self, "_byte_level", None) is None:  # read once (the backend is not changed after)
            backend = self._backend
            pre = json.loads(backend.pre_tokenizer.__getstate__()) if backend.pre_tokenizer is not None else {}
            steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
            self._byte_level = (
                backend.normalizer is None and type(backend.model).__name__ == "BPE"
                and not backend.model.fuse_unk
                and any(step.get("type") == "ByteLevel" for step in steps)
                and all(step.get("type") == "ByteLevel" or (step.get("type") == "Split" and step.get("behavior")
                                                            != "Removed") for step in steps)
                and not any(t.lstrip or t.rstrip for t in backend.get_added_tokens_decoder().values()))
        return self._byte_level

    def _bytes_spelled(self, data: bytes) -> int:
        """The bytes less those the backend drops: a byte whose byte-level character is not in the
        vocabulary, with no unk token to stand for it, encodes to nothing (SmolLM2 lacks 0x04,
        0x06, 0x13, ..., 0xF1, 0xF2: 1,000 of "\\x04" are 0 ids, and
        were counted as at least 1,000 / 81)."""
        if getattr(self, "_dropped", None) is None:
            vocab = self._backend.get_vocab()
            self._dropped = b"" if self._backend.model.unk_token is not None else \
                bytes(sorted(byte for char, byte in _BYTE_DECODER.items() if char not in vocab))
        return len(data) - sum(data.count(byte) for byte in self._dropped)

    def _longest_token_bytes(self) -> int:
        """From the vocabulary's strings (one character per byte, byte-level; an added token's
        text as UTF-8), not ``_token_bytes`` over every id, which took ~0.3 s and kept them all."""
        if getattr(self, "_longest", None) is None:
            added = {t.content for t in self._backend.get_added_tokens_decoder().values()}
            self._longest = max(len(piece.encode("utf-8")) if piece in added else len(piece)
                                for piece in self._backend.get_vocab(with_added_tokens=True))
        return self._longest

    def decode_bytes(self, ids: Iterable[int], *, skip_special_tokens: bool = False) -> bytes:
        """The tokens' bytes, concatenated. Sentencepiece decoders that drop the space they
        prepended when encoding (Metaspace ``first``, a leading ``Strip``) drop one leading
        space of the whole text, as the backend does.

        ``decode`` is this, decoded as UTF-8: for valid text it equals the backend's decode,
        and unlike the backend's byte fallback (which turns a whole run of byte tokens into
        U+FFFD when one is invalid) it is a function of each token and its predecessor, so
        streamed text can always equal decoding everything at once."""
        data = super().decode_bytes(ids, skip_special_tokens=skip_special_tokens)
        if self._decoder.strips_leading_space and data.startswith(b" "):
            data = data[1:]
        return data

    def _skippable_ids(self) -> frozenset[int]:
        # The backend's own rule (transformers' fast decode): added tokens flagged special. A role
        # token the file does not flag (some GGUFs' BOS) stays, as it does there.
        if self._added is None:
            self._added = self._backend.get_added_tokens_decoder()
        return frozenset(i for i, token in self._added.items() if token.special)

    def token_to_id(self, token: str) -> Optional[int]:
        return self._backend.token_to_id(token)

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The underlying ``tokenizers.Tokenizer`` (read it; changing it desynchronises us).
        An ``encode(..., allowed_special=False)`` running in another thread sets its
        ``encode_special_tokens`` for that call."""
        return self._backend

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()  # a lock cannot be copied or pickled: a copy gets its own
        del state["_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    # ----------------------------------------------------------------- save / load

    def save_hf(self, path: str | Path) -> None:
        """Write a plain Hugging Face ``tokenizer.json`` (no lucidlm fields). Its post-processor
        puts BOS first exactly when this tokenizer does: transformers' fast tokenizers add BOS
        only through it, whatever ``tokenizer_config.json`` says."""
        from lucidlm.staging import atomic_write_text

        atomic_write_text(Path(path), with_bos_post_processor(self._backend, self.bos_token if self.add_bos else None))

    def _to_dict(self) -> dict[str, Any]:
        return {
            # Kept as one string: parsing it as JSON only to re-serialise it for the backend
            # would double the cost of a warm model load.
            "tokenizer_json": self._backend.to_str(),
            "add_bos": self.add_bos, "add_eos": self.add_eos, "bos_token": self.bos_token, "eos_token": self.eos_token,
            "pad_token": self.pad_token, "unk_token": self.unk_token, "chat_template": self.chat_template,
            "eos_ids": list(self.eos_ids),
        }

    @classmethod
    def _from_dict(cls, data: dict[str, Any]) -> "HFTokenizer":
        from tokenizers import Tokenizer as Backend

        try:
            embedded = data["tokenizer_json"]
            backend = Backend.from_str(embedded if isinstance(embedded, str) else json.dumps(embedded))
        except BaseException as exc:  # noqa: BLE001 - a panic of the backend is a BaseException
            from lucidlm.tokenizers.hf_files import is_parse_failure

            if not is_parse_failure(exc):
                raise
            raise TokenizerError(f"the embedded tokenizer_json cannot be read "
                                 f"({' '.join(str(exc).split())[:200]})") from None
        check_backend_regexes(backend, "the embedded tokenizer_json")
        # absent in files saved before lucidlm kept every end id: the EOS role's id alone, as then
        eos_ids = Fields(data, "the saved tokenizer", TokenizerError,
                         fix="save the model again").list("eos_ids", default=None, item=int)
        size = backend.get_vocab_size(with_added_tokens=True)
        bad = [i for i in eos_ids or () if not 0 <= i < size]
        if bad:
            raise TokenizerError(f"the saved tokenizer's eos_ids hold {bad[0]}, outside its vocabulary of {size} "
                                 f"tokens; the file is damaged. Save the model again.")
        tokenizer = cls(backend, add_bos=bool(data.get("add_bos", False)), bos_token=data.get("bos_token"),
                        eos_token=data.get("eos_token"), pad_token=data.get("pad_token"),
                        unk_token=data.get("unk_token"), chat_template=data.get("chat_template"), eos_ids=eos_ids)
        tokenizer.add_eos = bool(data.get("add_eos", False))
        return tokenizer

    # ----------------------------------------------------------------- helpers

    def _piece_bytes(self, token_id: int, added: dict[int, Any]) -> bytes:
        token = self._backend.id_to_token(token_id)  # an added token's is its literal text
        if token is None:  # a hole in the id space
            return b""
        if self._decoder.byte_level:
            if token_id in added:  # literal text, not GPT-2's byte alphabet
                return token.encode("utf-8")
            if all(c in _BYTE_DECODER for c in token):
                return bytes(_BYTE_DECODER[c] for c in token)
        # sentencepiece style; the backend's decoder reads added tokens this way too
        if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):  # byte fallback
            return bytes([int(token[3:5], 16)])
        marker = self._decoder.space_marker
        return (token.replace(marker, " ") if marker else token).encode("utf-8")

    def __repr__(self) -> str:
        return f"HFTokenizer(vocab_size={self.vocab_size}, bos={self.bos_token!r}, eos={self.eos_token!r})"
