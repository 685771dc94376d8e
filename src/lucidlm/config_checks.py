"""The rules every ``ModelConfig`` obeys, checked when one is built, and the sizes derived
from it (head_dim, n_kv_heads, d_mlp).

Kept apart from ``config.py`` (the fields, their meaning, and reading and writing them) because
it is the longest single part of the config and changes for another reason: a new family's
constraint, a new bound. ``config.py`` re-exports the names below, so
``from lucidlm.config import llama_hidden_dim`` still works.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

from lucidlm.errors import ConfigError
from lucidlm.validation import MAX_CONTEXT, MAX_HEADS, MAX_LAYERS, MAX_VOCAB, MAX_WIDTH, Fields

POSITION_KINDS = ("rope", "sinusoidal", "learned", "none")
ROPE_VARIANTS = ("half", "interleaved")
NORM_KINDS = ("rms", "layer", "none")
NORM_POSITIONS = ("pre", "post")
MLP_KINDS = ("relu", "gelu", "gelu_tanh", "swiglu", "geglu")
INIT_SCHEMES = ("gpt2", "lecun")
# RoPE scaling rules (model/rope_scaling.py) and the parameters each one reads
ROPE_SCALING_PARAMETERS = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "frequency_factors": ("factors",),
}
ROPE_SCALING_TYPES = tuple(ROPE_SCALING_PARAMETERS)
# Meta's constants of the llama3 rule (Llama 3.1-3.3): what llama.cpp's converter fills in when a
# config leaves them out, and what Meta's params.json and a GGUF's rope_freqs leave implicit
LLAMA3_ROPE_DEFAULTS = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def check_and_complete(cfg: Any) -> None:
    """Check every field of ``cfg`` (a ``ModelConfig`` whose ``_origin`` is set) for type and
    range, coerce it, and fill in the derived sizes; ``ModelConfig.__post_init__`` calls this.
    Every field is checked before anything is built from it (a model of n_layers=10**6 would
    hang, max_seq_len=4e9 would ask for TBs of rotary tables). Refusals name where the values
    came from: "ModelConfig" for Python code, or the file a loader read them from, under that
    file's own field names (``ModelConfig.from_dict(names=...)``)."""
    source, _, fix = cfg._origin
    name = cfg._name
    check = Fields({name(f.name): getattr(cfg, f.name) for f in dataclasses.fields(cfg)}, source,
                   ConfigError, fix=fix)

    def put(kind: str, key: str, **bounds: Any) -> None:
        setattr(cfg, key, getattr(check, kind)(name(key), **bounds))

    for key, valid in (("positions", POSITION_KINDS), ("rope_variant", ROPE_VARIANTS), ("norm", NORM_KINDS),
                       ("norm_position", NORM_POSITIONS), ("mlp", MLP_KINDS), ("init", INIT_SCHEMES)):
        put("str", key, choices=valid)
    put("str", "name")
    for key, high in (("vocab_size", MAX_VOCAB), ("d_model", MAX_WIDTH), ("n_layers", MAX_LAYERS),
                      ("n_heads", MAX_HEADS), ("max_seq_len", MAX_CONTEXT), ("multiple_of", MAX_WIDTH)):
        put("int", key, low=1, high=high)
    put("int", "n_kv_heads", default=None, low=1, high=MAX_HEADS)
    put("int", "head_dim", default=None, low=1, high=MAX_WIDTH)
    put("int", "d_mlp", default=None, low=1, high=MAX_WIDTH)
    put("int", "sliding_window", default=None, low=1, high=MAX_CONTEXT)
    put("int", "global_layer_every", default=None, low=1, high=MAX_LAYERS)
    put("float", "ffn_dim_multiplier", default=None, low=0.0, low_open=True, high=float(MAX_WIDTH))
    put("float", "rope_theta", low=0.0, low_open=True)
    put("float", "rope_local_theta", default=None, low=0.0, low_open=True)
    cfg.rope_scaling = rope_scaling_complete(check, name("rope_scaling"))
    put("float", "query_pre_attn_scalar", default=None, low=0.0, low_open=True)
    put("float", "final_logit_softcap", default=None, low=0.0, low_open=True)
    put("float", "norm_eps", low=0.0, high=1.0)
    put("float", "dropout", low=0.0, high=1.0, high_open=True)
    for key in ("qk_norm", "post_sublayer_norm", "final_norm", "attn_bias", "mlp_bias", "norm_bias",
                "tie_embeddings", "unembed_bias", "scale_embeddings"):
        put("bool", key)
    put("bool", "attn_out_bias", default=cfg.attn_bias)

    # the sizes derived below, so that ModelConfig.replace derives them again from new sizes
    cfg._derived = {key for key in ("n_kv_heads", "head_dim", "d_mlp") if getattr(cfg, key) is None}
    if cfg.n_kv_heads is None:
        cfg.n_kv_heads = cfg.n_heads
    if cfg.n_kv_heads > cfg.n_heads:
        check.fail(f"{name('n_kv_heads')}={cfg.n_kv_heads} is more than {name('n_heads')}={cfg.n_heads}: each "
                   f"key/value head serves one or more query heads; pick {name('n_kv_heads')} from "
                   f"{_divisors(cfg.n_heads)}")
    if cfg.n_heads % cfg.n_kv_heads != 0:
        check.fail(f"{name('n_heads')}={cfg.n_heads} is not divisible by {name('n_kv_heads')}={cfg.n_kv_heads}: "
                   f"each key/value head must serve the same number of query heads; pick "
                   f"{name('n_kv_heads')} from {_divisors(cfg.n_heads)}")
    if cfg.head_dim is None:
        if cfg.d_model % cfg.n_heads != 0:
            check.fail(f"{name('d_model')}={cfg.d_model} is not divisible by {name('n_heads')}={cfg.n_heads}; "
                       f"set {name('head_dim')} explicitly or choose {name('n_heads')} from "
                       f"{_divisors(cfg.d_model)[:24]}")
        cfg.head_dim = cfg.d_model // cfg.n_heads
    if cfg.n_heads * cfg.head_dim > MAX_WIDTH:
        check.fail(f"{name('n_heads')}={cfg.n_heads} heads of {name('head_dim')}={cfg.head_dim} make "
                   f"{cfg.n_heads * cfg.head_dim} attention dimensions, more than {MAX_WIDTH}")
    if cfg.positions == "rope" and cfg.head_dim % 2 != 0:
        check.fail(f"{name('head_dim')}={cfg.head_dim} is odd, but RoPE rotates pairs of dimensions; "
                   f"use an even head_dim or positions='learned'/'sinusoidal'/'none'")
    if cfg.positions == "sinusoidal" and cfg.d_model % 2 != 0:
        check.fail(f"sinusoidal positions need an even {name('d_model')}, got {cfg.d_model}")
    if cfg.d_mlp is None:
        cfg.d_mlp = llama_hidden_dim(cfg.d_model, cfg.multiple_of, cfg.ffn_dim_multiplier) \
            if cfg.mlp in ("swiglu", "geglu") else 4 * cfg.d_model
        if cfg.d_mlp > MAX_WIDTH:
            check.fail(f"the feed-forward width derived from {name('d_model')}={cfg.d_model} is {cfg.d_mlp}, "
                       f"more than {MAX_WIDTH}; set {name('d_mlp')}")
    if cfg.global_layer_every is not None and cfg.sliding_window is None:
        check.fail(f"global_layer_every={cfg.global_layer_every} needs a sliding_window for the "
                   f"other layers; set sliding_window or leave global_layer_every None")
    if cfg.post_sublayer_norm and cfg.norm_position != "pre":
        check.fail("post_sublayer_norm adds norms around pre-norm sub-layers; it needs norm_position='pre'")
    if cfg.rope_scaling is not None and cfg.positions != "rope":
        check.fail(f"rope_scaling={cfg.rope_scaling!r} scales RoPE, but positions={cfg.positions!r}; "
                   f"drop rope_scaling or use positions='rope'")
    factors = (cfg.rope_scaling or {}).get("factors")
    if factors is not None and cfg.positions == "rope" and len(factors) != cfg.head_dim // 2:
        check.fail(f"rope_scaling has {len(factors)} frequency factors, but {name('head_dim')}={cfg.head_dim} "
                   f"rotates {cfg.head_dim // 2} pairs; give one factor per pair")
    if cfg.norm == "none" and (cfg.qk_norm or cfg.post_sublayer_norm):
        check.fail("norm='none' has no norm to use for qk_norm / post_sublayer_norm; pick norm='rms'")


def rope_scaling_complete(check: Fields, key: str) -> Optional[dict[str, Any]]:
    """``rope_scaling`` checked and completed: None for none (or ``rope_type`` "default"), else a
    new dict with every parameter its rule uses (model/rope_scaling.py), defaults filled in as
    llama.cpp's converter fills them (low 1, high 4, original context 8192)."""
    if check.raw(key, None) is None:
        return None
    given = check.object(key)
    kind = given.str("rope_type", choices=ROPE_SCALING_TYPES + ("default",))
    unknown = sorted(set(given.data) - {"rope_type", *ROPE_SCALING_PARAMETERS.get(kind, ())})
    if unknown:
        given.fail(f"{key} of type {kind!r} has no parameter {', '.join(map(repr, unknown))}; its parameters are "
                   f"{', '.join(ROPE_SCALING_PARAMETERS.get(kind, ())) or 'none'}")
    if kind == "default":
        return None
    if kind == "frequency_factors":
        factors = given.list("factors")
        if not factors or not all(isinstance(f, (int, float)) and not isinstance(f, bool) and math.isfinite(f)
                                  and f > 0 for f in factors):
            given.fail(f"{key}.factors must be positive finite numbers, one per rotated pair")
        return {"rope_type": kind, "factors": [float(f) for f in factors]}
    complete = {"rope_type": kind, "factor": given.float("factor", low=0.0, low_open=True)}
    if kind == "llama3":
        low = given.float("low_freq_factor", default=LLAMA3_ROPE_DEFAULTS["low_freq_factor"], low=0.0, low_open=True)
        high = given.float("high_freq_factor", default=LLAMA3_ROPE_DEFAULTS["high_freq_factor"], low=0.0,
                           low_open=True)
        if high <= low:
            given.fail(f"{key}.high_freq_factor={high:g} must exceed low_freq_factor={low:g}: the rule blends "
                       f"between the two wavelengths they set")
        complete.update(low_freq_factor=low, high_freq_factor=high, original_max_position_embeddings=given.int(
            "original_max_position_embeddings", default=LLAMA3_ROPE_DEFAULTS["original_max_position_embeddings"], low=1,
            high=MAX_CONTEXT))
    return complete


def llama_hidden_dim(d_model: int, multiple_of: int, ffn_dim_multiplier: Optional[float] = None) -> int:
    """LLaMA's SwiGLU width: 2/3 of 4*d (so the 3-matrix MLP costs what a 2-matrix one would),
    optionally scaled, then rounded up to a multiple of ``multiple_of`` for hardware efficiency."""
    hidden = int(2 * (4 * d_model) / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * math.ceil(hidden / multiple_of)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


__all__ = ["INIT_SCHEMES", "MLP_KINDS", "NORM_KINDS", "NORM_POSITIONS", "POSITION_KINDS", "LLAMA3_ROPE_DEFAULTS", "ROPE_SCALING_PARAMETERS",
           "ROPE_SCALING_TYPES", "ROPE_VARIANTS", "check_and_complete", "llama_hidden_dim", "rope_scaling_complete"]
