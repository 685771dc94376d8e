"""How a ``tokenizer.json``'s decoder turns tokens back into text, read once at load.

``HFTokenizer`` decodes token by token itself (so streamed text always equals decoding
everything at once, see ``HFTokenizer.decode_bytes``) instead of calling the backend's
``decode``. That only works for the decoders it mirrors, which are those of the decoder-only
models people use:

- byte-level (GPT-2, Llama 3, Qwen, SmolLM): ``ByteLevel``, GPT-2's byte alphabet;
- sentencepiece-style (Llama 2, Gemma, Mistral): ``Metaspace`` or ``Replace("▁", " ")``,
  with ``ByteFallback`` (``<0xNN>`` tokens), ``Fuse`` and a leading ``Strip``.

Anything else (WordPiece's ``##``, a BPE end-of-word suffix, CTC, other replacements) is
refused when the tokenizer is loaded: decoding it as if it were one of the above would give
text that silently differs from the model's own.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional

from lucidlm.errors import TokenizerError

_HARMLESS = {"ByteFallback", "Fuse"}  # <0xNN> tokens are always read as bytes; fusing is joining


@dataclass(frozen=True)
class DecoderPlan:
    """byte_level: tokens are spelled in GPT-2's byte alphabet. space_marker: the character
    that stands for a space in sentencepiece-style tokens ("▁"), or None. strips_leading_space:
    the decoder drops the space the encoder put before the text (Metaspace ``first``/``always``,
    a leading ``Strip``)."""

    byte_level: bool
    space_marker: Optional[str]
    strips_leading_space: bool


def decoder_steps(backend: Any) -> list[dict[str, Any]]:
    """The backend's decoder as a flat list of JSON steps (a Sequence is unrolled)."""
    if backend.decoder is None:
        return []
    spec = json.loads(backend.decoder.__getstate__().decode("utf-8"))
    return spec.get("decoders", [spec]) if spec.get("type") == "Sequence" else [spec]


def plan_decoder(backend: Any, source: str) -> DecoderPlan:
    """What the decoder does, or one TokenizerError naming the step lucidlm cannot mirror."""
    steps = decoder_steps(backend)
    if not steps:  # no decoder: tokens are joined as they are ("▁" still read as a space)
        return DecoderPlan(byte_level=False, space_marker="\u2581", strips_leading_space=False)
    byte_level, marker, strips = False, None, False
    for step in steps:
        kind = step.get("type")
        if kind == "ByteLevel":
            byte_level = True
        elif kind == "Metaspace":
            marker = step.get("replacement", "\u2581")
            strips = strips or (step.get("prepend_scheme", "always") != "never" and step.get("add_prefix_space", True))
        elif kind == "Replace" and step.get("content") == " " and "String" in (step.get("pattern") or {}):
            marker = step["pattern"]["String"]
        elif kind == "Strip" and step.get("content") == " " and step.get("start", 0) <= 1 and not step.get("stop"):
            strips = strips or step.get("start", 0) == 1
        elif kind not in _HARMLESS:
            detail = json.dumps({k: v for k, v in step.items() if k != "type"}, ensure_ascii=False)[:80]
            raise TokenizerError(
                f"{source}: its decoder step {kind} {detail} is not one lucidlm can decode (it mirrors byte-level "
                f"and sentencepiece-style decoders: ByteLevel, Metaspace, Replace of a space marker, ByteFallback, "
                f"Fuse, a leading Strip). Use a decoder-only LM's tokenizer of one of those kinds.")
    return DecoderPlan(byte_level=byte_level, space_marker=marker, strips_leading_space=strips and not byte_level)


__all__ = ["DecoderPlan", "decoder_steps", "plan_decoder"]
