"""Merging Meta's model-parallel shards (``consolidated.00.pth`` ... ``consolidated.NN.pth``).

Meta's larger Llama releases (70B: 8 shards) split every matrix across model-parallel ranks the
way its ``fairscale`` layers ran: column-parallel layers (``wq``/``wk``/``wv``, ``w1``/``w3``,
``output``) are cut along their output rows (dim 0), row-parallel ones (``wo``, ``w2``) along their
input columns (dim 1), and norms are copied whole into every shard. The token embedding is cut
along the vocabulary (dim 0) in Llama 3 and along the model width (dim 1) in Llama 1/2; which one a
checkpoint uses is read off the shard's shape, which tells the two apart for any shard count > 1.
This is the layout transformers' ``convert_llama_weights_to_hf`` stitches back together.

Q/K rows stay in Meta's interleaved order here: a shard holds whole heads, so concatenating along
dim 0 gives the unsharded matrix, which ``meta_tensors`` then permutes as for a single shard.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

import torch

from lucidlm.config import ModelConfig
from lucidlm.errors import CheckpointError

SHARD_NAME = re.compile(r"consolidated\.(\d+)\.pth")
REPLICATED = None  # concat dim of tensors every shard holds whole
SPLIT_DIMS = {  # Meta name suffix -> dim the shards cut it along
    "attention.wq.weight": 0, "attention.wk.weight": 0, "attention.wv.weight": 0, "attention.wo.weight": 1,
    "feed_forward.w1.weight": 0, "feed_forward.w3.weight": 0, "feed_forward.w2.weight": 1,
    "attention_norm.weight": REPLICATED, "ffn_norm.weight": REPLICATED, "norm.weight": REPLICATED,
    "output.weight": 0,
}


def shard_paths(directory: Path) -> list[Path]:
    """The shard files in rank order, refusing a gap or a stray name (a partial download)."""
    found = {}
    for path in directory.glob("consolidated.*.pth"):
        match = SHARD_NAME.fullmatch(path.name)
        if match is None:
            raise CheckpointError(f"{path}: not a Meta shard name (consolidated.NN.pth); move it out of {directory}.")
        found[int(match.group(1))] = path
    missing = [f"consolidated.{i:02d}.pth" for i in range(max(found) + 1) if i not in found]
    if missing:
        raise CheckpointError(f"{directory} holds {len(found)} shards but lacks {', '.join(missing)}; "
                              f"download the missing model-parallel shard(s) again.")
    return [found[i] for i in sorted(found)]


def full_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Unsharded shape of each Meta tensor suffix, from params.json's sizes."""
    d, mlp = config.d_model, config.d_mlp
    return {"attention.wq.weight": (config.q_dim, d), "attention.wk.weight": (config.kv_dim, d),
            "attention.wv.weight": (config.kv_dim, d), "attention.wo.weight": (d, config.q_dim),
            "feed_forward.w1.weight": (mlp, d), "feed_forward.w3.weight": (mlp, d), "feed_forward.w2.weight": (d, mlp),
            "attention_norm.weight": (d,), "ffn_norm.weight": (d,), "norm.weight": (d,),
            "output.weight": (config.vocab_size, d), "tok_embeddings.weight": (config.vocab_size, d)}


def split_dim(suffix: str, piece: torch.Size, full: tuple[int, ...], n: int) -> int | None:
    """The dim a shard cuts this tensor along; the embedding's depends on the Llama version."""
    if suffix != "tok_embeddings.weight":
        return SPLIT_DIMS[suffix]
    return 1 if (piece[0] == full[0] and piece[1] * n == full[1]) else 0  # Llama 1/2 cut the width


def merge_shards(shards: Iterable[tuple[Path, dict[str, torch.Tensor]]], n_shards: int,
                 config: ModelConfig) -> dict[str, torch.Tensor]:
    """One state dict from ``n_shards`` (path, tensors) pairs read one at a time, in rank order.

    Every shard must hold the same names, each piece the 1/n_shards slice params.json implies;
    replicated norms must agree across shards. Errors name the shard file and the tensor.
    """
    if config.n_kv_heads % n_shards or config.n_heads % n_shards:
        raise CheckpointError(f"{n_shards} shards cannot split {config.n_heads} query / {config.n_kv_heads} KV heads "
                              f"evenly; is a shard missing or extra, or params.json from another model?")
    shapes = full_shapes(config)
    pieces: dict[str, list[torch.Tensor]] = {}
    names: list[str] | None = None
    for path, tensors in shards:
        if names is None:
            names = list(tensors)
        elif set(tensors) != set(names):
            diff = sorted(set(names) ^ set(tensors))[:3]
            raise CheckpointError(f"{path}: its tensor names differ from the first shard's (e.g. {diff}); "
                                  f"the shards come from different checkpoints or one is corrupt.")
        for name, piece in tensors.items():
            suffix = _suffix(name)
            if suffix not in shapes:  # rope.freqs or a stray name: meta_tensors decides
                pieces.setdefault(name, [piece])
                continue
            full = shapes[suffix]
            dim = split_dim(suffix, piece.shape, full, n_shards)
            want = full if dim is None else tuple(s // n_shards if i == dim else s for i, s in enumerate(full))
            if tuple(piece.shape) != want or (dim is not None and full[dim] % n_shards):
                raise CheckpointError(f"{path}: tensor {name!r} has shape {tuple(piece.shape)}, expected {want} "
                                      f"(1/{n_shards} of {full} from params.json); is a shard missing, or "
                                      f"params.json from another model?")
            if dim is None:
                if name in pieces and not torch.equal(pieces[name][0], piece):
                    raise CheckpointError(f"{path}: replicated tensor {name!r} differs from the first shard's copy; "
                                          f"the shards come from different checkpoints.")
                pieces.setdefault(name, [piece])
            else:
                pieces.setdefault(name, []).append(piece)
    # [*, full] per tensor: cat the rank-ordered pieces along the dim they were cut
    return {name: parts[0] if len(parts) == 1 else
            torch.cat(parts, dim=split_dim(_suffix(name), parts[0].shape, shapes[_suffix(name)], n_shards))
            for name, parts in pieces.items()}


def _suffix(name: str) -> str:
    return name.split(".", 2)[-1] if name.startswith("layers.") else name
