"""``lucidlm_adapter.json``, the file every adapter directory holds beside its tensors: the
method (lora | adapter | prefix), its settings, and who the base model was, so that a
mismatch can be named in an error message.

Read by saving (``files.py``) and loading (``adapter_loading.py``) alike, so it lives apart
from both; ``files.py`` re-exports these names.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any, Optional

from torch import nn

from lucidlm.errors import AdapterError
from lucidlm.peft import adapters
from lucidlm.peft.trainable import METHODS
from lucidlm.validation import MAX_CONTEXT, MAX_WIDTH, Fields, read_json_object

META_NAME = "lucidlm_adapter.json"
# 2: the q/k lora_B rows of an interleaved-RoPE model are in Hugging Face's order, as PEFT needs
# them for its export (peft_format.qk_rows_to_hf); version 1 wrote them in the model's own order.
FORMAT_VERSION = 2


# ModelConfig fields added since adapters were first saved, oldest first. A file saved before a
# group existed hashed the config without it (and without every later group): the same base
# when those fields hold their defaults. A new ModelConfig field joins the end, in a group of its
# own (tests/peft/test_adapter_base_identity.py holds this to ModelConfig's fields).
LATER_CONFIG_FIELDS: tuple[tuple[str, ...], ...] = (
    ("init",),
    ("final_logit_softcap", "global_layer_every", "post_sublayer_norm", "qk_norm", "query_pre_attn_scalar",
     "rope_local_theta", "scale_embeddings", "sliding_window"),
    ("rope_scaling",),
)


def base_identity(model: nn.Module) -> dict[str, Any]:
    """Enough about the base model to tell a user which one an adapter belongs to."""
    cfg = model.config.to_dict()
    keys = ("name", "vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_mlp")
    return {"config_sha256": _digest(cfg), **{k: cfg[k] for k in keys}}


def is_saved_base(saved_digest: Any, config: Any) -> bool:
    """Whether ``saved_digest`` (a file's base config_sha256) is ``config`` as this or an earlier
    lucidlm hashed it: before LATER_CONFIG_FIELDS existed, the hash left them out."""
    cfg = config.to_dict()
    if saved_digest == _digest(cfg):
        return True
    defaults = {f.name: f.default for f in dataclasses.fields(config)}
    for group in reversed(LATER_CONFIG_FIELDS):
        if any(cfg.pop(name) != defaults[name] for name in group):
            return False  # this model needs a field the earlier lucidlm did not have
        if saved_digest == _digest(cfg):
            return True
    return False


def _digest(cfg: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(cfg, sort_keys=True).encode()).hexdigest()[:16]


def read_meta(directory: Path) -> Optional[dict[str, Any]]:
    """lucidlm_adapter.json (None when absent), its method and settings checked for type and
    range; the sizes that depend on the base model are checked again when it is applied."""
    fields = meta_fields(directory)
    if fields is None:
        return None
    meta = dict(fields.data)
    meta["method"] = fields.str("method", choices=METHODS)
    # Files written before format_version existed are format 1. A later format may lay the
    # tensors out otherwise (format 2 moved q/k rows), so reading it as this one would be silent.
    meta["format_version"] = fields.format_version("format_version", FORMAT_VERSION, to="load this adapter")
    meta["base"] = dict(fields.object("base", default={}).data)
    if meta["method"] == "adapter":
        meta.update(bottleneck=fields.int("bottleneck", low=1, high=MAX_WIDTH),
                    nonlinearity=fields.str("nonlinearity", default="gelu", choices=tuple(adapters.NONLINEARITIES)),
                    train_norms=fields.bool("train_norms", default=False))
    elif meta["method"] == "prefix":
        meta.update(length=fields.int("length", low=1, high=MAX_CONTEXT),
                    hidden=fields.int("hidden", default=None, low=1, high=MAX_WIDTH),
                    frozen=fields.bool("frozen", default=False))
    elif meta.get("adapter_name") is not None:
        fields.str("adapter_name")
    return meta


def meta_fields(directory: Path) -> Optional[Fields]:
    path = directory / META_NAME
    if not path.exists():
        return None
    return read_json_object(path, AdapterError, "lucidlm adapter file", fix=_FIX)


_FIX = "fix it or save the adapter again (lucidlm finetune)"


__all__ = ["META_NAME", "METHODS", "base_identity", "is_saved_base", "meta_fields", "read_meta"]
