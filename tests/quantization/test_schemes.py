"""int8 / int4 weight-only quantization against an independent NumPy reference of each scheme.

The reference below is written from the schemes' definitions (the docstrings of
quantization/int8.py and int4.py), not from the code: NumPy float32 arithmetic, with
bfloat16 rounding of the scales done on the bits (round to nearest, ties to even).
"""

import copy

import numpy as np
import pytest
import torch

import lucidlm
from lucidlm.config import preset
from lucidlm.errors import QuantizationError
from lucidlm.quantization import Int4Linear, Int8Linear, QuantizedEmbedding, QuantizedLinear, blocks_kernel, quantize
from lucidlm.quantization.int4 import DEQUANTIZE_ROWS, tile_rows


def bf16_round(x: np.ndarray) -> np.ndarray:
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.astype(np.uint32).view(np.float32)


def ref_int8(w: np.ndarray, group: int | None) -> np.ndarray:
    """Symmetric int8: scale = max|w| / 127 per group (bf16), codes round(w / scale) in [-127, 127]."""
    N, K = w.shape
    g = group or K
    wg = w.reshape(N, K // g, g)
    scale = bf16_round((np.abs(wg).max(-1) / np.float32(127)).astype(np.float32))
    safe = np.where(scale == 0, np.float32(1), scale)
    codes = np.clip(np.round(wg / safe[..., None]), -127, 127)
    return (codes * scale[..., None]).reshape(N, K).astype(np.float32)


def ref_int4(w: np.ndarray, group: int) -> np.ndarray:
    """Asymmetric int4: scale = (max - min) / 15, zero = min + 8 scale (both bf16),
    codes round((w - zero) / scale + 8) in [0, 15], w ~ (codes - 8) scale + zero."""
    N, K = w.shape
    wg = w.reshape(N, K // group, group)
    low, high = wg.min(-1), wg.max(-1)
    scale = bf16_round(((high - low) / np.float32(15)).astype(np.float32))
    zero = bf16_round((low + np.float32(8) * scale).astype(np.float32))
    safe = np.where(scale == 0, np.float32(1), scale)
    codes = np.clip(np.round((wg - zero[..., None]) / safe[..., None] + np.float32(8)), 0, 15)
    return ((codes - 8) * scale[..., None] + zero[..., None]).reshape(N, K).astype(np.float32)


CASES = [(Int8Linear, None), (Int8Linear, 32), (Int8Linear, 64), (Int4Linear, 32), (Int4Linear, 64),
         (Int4Linear, 128)]


@pytest.mark.parametrize("cls,group", CASES)
def test_packed_weights_dequantize_to_the_numpy_reference(cls, group):
    torch.manual_seed(0)
    linear = torch.nn.Linear(256, 40)  # 40 rows: not a multiple of the CPU kernel's 16-row tiles
    with torch.no_grad():
        linear.weight[3] = 0.0  # an all-zero row: scale 0 must not divide by zero
        linear.weight[5, :] = 0.25  # a constant row
    q = cls.from_float(linear, group)
    w = linear.weight.detach().numpy()
    expected = ref_int8(w, group) if cls is Int8Linear else ref_int4(w, group)
    # dequantize() reads the codes back out of the kernel's layout (int4: opaque CPU tiles).
    np.testing.assert_array_equal(q.dequantize().numpy(), expected)
    # The kernel multiplies by exactly those weights (bf16 activations, bf16 output rounding).
    x = torch.randn(5, 256)
    want = x.bfloat16().double() @ torch.from_numpy(expected).double().T + linear.bias.detach().double()
    torch.testing.assert_close(q(x).double(), want, atol=2e-2, rtol=1e-2)
    # The plain layout rebuilds the same module.
    again = cls.from_plain(q.plain_state(), 256, group, linear.bias.detach())
    assert torch.equal(again(x), q(x))


@pytest.mark.parametrize("group", [32, 128])
def test_int4_tiles_read_back_by_shifts_equal_the_numpy_reference_and_the_kernels_own(group):
    """Rows in whole tile blocks: the codes come back from torch's tiles by views and shifts
    (``codes_from_tiles``), and the float matrix they give is the NumPy reference's and,
    bit for bit, what the kernel itself multiplies by (its product with the identity)."""
    assert tile_rows() is not None, "torch's CPU int4 tile order changed: codes_from_tiles needs a look"
    torch.manual_seed(1)
    linear = torch.nn.Linear(256, 3 * tile_rows(), bias=False)
    with blocks_kernel.prefer(False):  # torch's tiles, not lucidlm's own kernel
        q = Int4Linear.from_float(linear, group)
    assert q.tile_block == tile_rows()
    expected = ref_int4(linear.weight.detach().numpy(), group)
    np.testing.assert_array_equal(q.dequantize().numpy(), expected)
    np.testing.assert_array_equal(q.dequantized_tiles().float().numpy(), bf16_round(expected))
    eye = torch.eye(256, dtype=torch.bfloat16)
    kernel_view = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, q.weight_int4, group, q.scales_and_zeros).t()
    assert torch.equal(q.dequantized_tiles(), kernel_view)


def test_compiled_int4_matmuls_dequantize_for_prompts_and_keep_the_kernel_for_decoding():
    """Inside torch.compile, a fixed row count of DEQUANTIZE_ROWS or more goes through
    F.linear on the unpacked weights, fewer through torch's int4 kernel, and a symbolic one
    (a prompt pass compiled for every length) always dequantizes, without a guard on its
    value; eagerly always the kernel. Both give the reference product to bfloat16 accuracy."""
    torch.manual_seed(2)
    linear = torch.nn.Linear(256, 192, bias=False)
    with blocks_kernel.prefer(False):  # torch's tiles; lucidlm's kernel is one op at every row count
        q = Int4Linear.from_float(linear, 32)
    expected = torch.from_numpy(ref_int4(linear.weight.detach().numpy(), 32)).double()
    seen: list[set] = []

    def recording_backend(gm, example_inputs):
        seen.append({str(node.target) for node in gm.graph.nodes if node.op == "call_function"})
        return gm.forward

    for rows, dequantizes in ((DEQUANTIZE_ROWS - 1, False), (DEQUANTIZE_ROWS, True), (300, True)):
        x = torch.randn(rows, 256)
        torch._dynamo.reset()
        seen.clear()
        compiled = torch.compile(q, backend=recording_backend, fullgraph=True)(x)
        kernel_used = any("_weight_int4pack_mm_for_cpu" in target for target in seen[0])
        assert kernel_used != dequantizes, (rows, seen[0])
        want = x.bfloat16().double() @ expected.T
        torch.testing.assert_close(compiled.double(), want, atol=2e-2, rtol=1e-2)
        torch.testing.assert_close(q(x).double(), want, atol=2e-2, rtol=1e-2)  # eager: the kernel
    torch._dynamo.reset()
    seen.clear()
    dynamic = torch.compile(q, backend=recording_backend, fullgraph=True, dynamic=True)
    for rows in (5, 200):  # one graph for both: its row count is symbolic
        x = torch.randn(rows, 256)
        torch.testing.assert_close(dynamic(x).double(), x.bfloat16().double() @ expected.T, atol=2e-2, rtol=1e-2)
    assert len(seen) == 1 and not any("_weight_int4pack_mm_for_cpu" in target for target in seen[0]), seen
    torch._dynamo.reset()
    inductor = torch.compile(q, fullgraph=True)(x)  # the real compiler, 200 rows
    torch.testing.assert_close(inductor.double(), x.bfloat16().double() @ expected.T, atol=2e-2, rtol=1e-2)
    torch._dynamo.reset()


def test_int4_plain_layout_is_low_nibble_first():
    linear = torch.nn.Linear(32, 16, bias=False)
    with torch.no_grad():
        linear.weight.copy_(torch.arange(16 * 32, dtype=torch.float32).reshape(16, 32) % 16)  # codes = w per group
    plain = Int4Linear.from_float(linear, 32).plain_state()
    row = plain["weight_int4"][0].numpy()
    assert row[0] == (0 | 1 << 4) and row[1] == (2 | 3 << 4)  # column 2i low, 2i + 1 high
    assert plain["scales"][0, 0].item() == 1.0 and plain["zeros"][0, 0].item() == 8.0


def tiny_llama(tie=True):
    torch.manual_seed(0)
    cfg = preset("llama", vocab_size=96, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_mlp=128,
                 max_seq_len=64, tie_embeddings=tie)
    return lucidlm.Transformer(cfg).eval()


@pytest.mark.parametrize("scheme,group", [("int8", None), ("int4", 32)])
def test_quantize_swaps_every_linear_and_ties_embeddings_once(scheme, group):
    model = tiny_llama()
    ids = torch.randint(0, 96, (2, 10))
    with torch.no_grad():
        want = model(ids)
    float_embed = model.embed.weight.detach().clone()
    q = quantize(copy.deepcopy(model), scheme, group)
    assert not any(type(m) is torch.nn.Linear for m in q.modules())
    assert isinstance(q.embed, QuantizedEmbedding) and isinstance(q.unembed, QuantizedLinear)
    # Tied: both modules stand for one quantized matrix, that of the reference scheme.
    ref = ref_int8(float_embed.numpy(), group) if scheme == "int8" else ref_int4(float_embed.numpy(), group)
    np.testing.assert_array_equal(q.embed.dequantize().numpy(), ref)
    np.testing.assert_array_equal(q.unembed.dequantize().numpy(), ref)
    np.testing.assert_array_equal(q.embed(ids).numpy(), ref[ids.numpy()])  # the lookup gathers those rows
    with torch.no_grad():
        got = q(ids)
    assert got.dtype == torch.float32 and q.dtype == torch.float32
    assert (got - want).abs().max() < (0.1 if scheme == "int8" else 0.5) * want.abs().max()


def test_hooks_and_run_with_cache_work_on_a_quantized_model():
    from lucidlm.inspect import run_with_cache

    model = quantize(tiny_llama(), "int4")
    ids = torch.randint(0, 96, (1, 12))
    logits, cache = run_with_cache(model, ids)
    float_logits, float_cache = run_with_cache(tiny_llama(), ids)
    assert set(cache.keys()) == set(float_cache.keys())
    with torch.no_grad():
        plain = model(ids)
    # Hooks make the norms take their spelled-out path (float32, a rounding apart from the fused
    # one), and lucidlm's kernel quantizes its float32 input to int8 codes, so a last-bit
    # difference can move a code by one: ~1e-4 of the logits' scale, never more.
    torch.testing.assert_close(logits, plain, atol=1e-3 * plain.abs().max().item(), rtol=0)
    # The cached MLP input of layer 1 is what its (quantized) up_proj saw: recompute its output.
    up = model.blocks[1].mlp.up_proj
    with torch.no_grad():
        assert torch.equal(cache["blocks.1.mlp.hook_pre_linear"], up(cache["blocks.1.ln2.hook_normalized"]))

    def zero_head(z, hook):
        z[:, :, 0] = 0.0
        return z
    model.blocks[0].attn.hook_z.add_hook(zero_head)
    with torch.no_grad():
        patched = model(ids)
    model.reset_hooks()
    assert not torch.equal(patched, logits)


def test_save_and_load_a_quantized_model(tmp_path):
    from lucidlm.weights.checkpoint import save_model

    model = quantize(tiny_llama(), "int4", 32)
    save_model(model, tmp_path)
    again = lucidlm.load(tmp_path)
    assert isinstance(again.blocks[0].mlp.down_proj, Int4Linear) and isinstance(again.embed, QuantizedEmbedding)
    ids = torch.randint(0, 96, (2, 9))
    blocks_kernel.use_cpu_loops(model)  # what the loader switched on for ``again``: the same arithmetic
    with torch.no_grad():
        assert torch.equal(again(ids), model(ids))
    for name, tensor in model.state_dict().items():
        assert torch.equal(again.state_dict()[name], tensor), name


@pytest.mark.parametrize("version, says", [(2, "has format 2, newer than this lucidlm reads.*upgrade lucidlm"),
                                           ("1", "field 'format' is '1'; expected an integer.*Re-save")])
def test_a_quantization_layout_of_another_format_is_refused(tmp_path, version, says):
    """quantization.json says which format its codes are stored in; a later lucidlm's (or a damaged
    number) was read as this one's without a look, where codes laid out otherwise would give other weights."""
    import json

    from lucidlm.errors import CheckpointError
    from lucidlm.weights.checkpoint import save_model

    save_model(quantize(tiny_llama(), "int4", 32), tmp_path)
    layout = json.loads((tmp_path / "quantization.json").read_text())
    assert layout["format"] == 1  # what every lucidlm so far has written
    (tmp_path / "quantization.json").write_text(json.dumps({**layout, "format": version}))
    with pytest.raises(CheckpointError, match=says):
        lucidlm.load(tmp_path)


@pytest.mark.parametrize("tie", [True, False])
def test_an_int8_per_channel_model_read_back_from_its_file_runs(tmp_path, tie):
    """safetensors' load_file hands out views of one file buffer at the file's own offsets, and
    torch's per-channel int8 kernel (_weight_int8pack_mm) crashed the whole process on codes that
    are not 16-byte aligned: a model saved with --quantize int8 segfaulted on its first forward.
    Read back, it computes what it computed before it was saved, bit for bit."""
    from lucidlm.weights.checkpoint import save_model

    model = quantize(tiny_llama(tie), "int8")
    save_model(model, tmp_path)
    again = lucidlm.load(tmp_path)
    assert isinstance(again.blocks[0].attn.q_proj, Int8Linear) and again.blocks[0].attn.q_proj.group_size is None
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(again(ids), model(ids))


def test_float_embeddings_stay_one_float_matrix_and_save(tmp_path):
    """embeddings=False: every other matrix is quantized, the tied embedding and unembedding
    stay the model's own float matrix (one tensor), and the mixed model saves and loads back."""
    from lucidlm.weights.checkpoint import save_model

    float_model = tiny_llama()
    model = quantize(copy.deepcopy(float_model), "int4", 32, embeddings=False)
    assert type(model.embed) is torch.nn.Embedding and type(model.unembed) is torch.nn.Linear
    assert model.unembed.weight is model.embed.weight
    assert torch.equal(model.embed.weight, float_model.embed.weight)
    assert all(isinstance(model.get_submodule(name), Int4Linear) for name, m in float_model.named_modules()
               if type(m) is torch.nn.Linear and name != "unembed")
    ids = torch.randint(0, 96, (2, 9))
    with torch.no_grad():  # quantized layers in between, the same float table at both ends
        assert torch.equal(model.embed(ids), float_model.embed(ids))
    save_model(model, tmp_path)
    again = lucidlm.load(tmp_path)
    assert type(again.embed) is torch.nn.Embedding and again.unembed.weight is again.embed.weight
    assert isinstance(again.blocks[0].attn.q_proj, Int4Linear)
    blocks_kernel.use_cpu_loops(model)  # what the loader switched on for ``again``: the same arithmetic
    with torch.no_grad():
        assert torch.equal(again(ids), model(ids))


@pytest.mark.parametrize("tie", [True, False])
def test_parameter_count_and_banner_describe_what_the_codes_stand_for(tie):
    """A quantized model has as many parameters as its float self (codes stand for weights, a
    tied matrix counts once), and chat's banner says how they are held."""
    from lucidlm.commands.chat import _weights

    float_model = tiny_llama(tie)
    expected = sum(p.numel() for p in float_model.parameters())  # nn.Module's own count: ties once
    assert float_model.num_parameters() == expected and _weights(float_model) == "float32 weights"
    for scheme, group, embeddings, banner in (("int4", 32, True, "int4/32 layers, int4/32 embedding"),
                                              ("int8", None, True, "int8 per channel layers, int8 per channel embedding"),
                                              ("int4", 32, False, "int4/32 layers, float32 embedding")):
        model = quantize(copy.deepcopy(float_model), scheme, group, embeddings=embeddings)
        assert model.num_parameters() == expected, (scheme, embeddings)
        assert model.num_parameters(trainable_only=True) == sum(p.numel() for p in model.parameters())
        assert _weights(model) == banner


def test_peft_methods_refuse_a_quantized_model_before_changing_it():
    from lucidlm.peft import add_adapters, add_lora, add_prefix

    model = quantize(tiny_llama(), "int4", 32, embeddings=False)
    before = {name: type(m) for name, m in model.named_modules()}
    for add, action in ((lambda: add_lora(model), "adding LoRA"), (lambda: add_adapters(model, 8), "adding bottleneck"),
                        (lambda: add_prefix(model, 4), "prefix tuning")):
        with pytest.raises(QuantizationError, match=rf"{action}.*quantized.*dtype='float32'"):
            add()
    assert {name: type(m) for name, m in model.named_modules()} == before
    assert all(p.requires_grad for p in model.parameters())  # nothing was frozen either


# ------------------------------------------------------------------------------- bad input


def test_unknown_scheme_names_the_known_ones():
    with pytest.raises(QuantizationError, match=r"'int3'.*int4, int8"):
        quantize(tiny_llama(), "int3")


def test_group_size_must_divide_the_input_width():
    model = tiny_llama()
    with pytest.raises(QuantizationError, match=r"group_size=48 does not divide the input width 64.*32"):
        quantize(model, "int4", group_size=48)
    assert type(model.blocks[0].attn.q_proj) is torch.nn.Linear  # nothing was half-swapped


def test_a_quantized_model_refuses_to_train():
    model = quantize(tiny_llama(), "int8")
    with pytest.raises(QuantizationError, match="cannot be trained.*dtype='float32'"):
        model.train()
    with pytest.raises(QuantizationError, match=r"\.dequantize\(\)"):
        model.blocks[0].mlp.up_proj.weight
    # An optimizer over its parameters would only see the norms: the train() gate catches it.
    assert all(p.ndim == 1 for p in model.parameters())


def test_int4_on_cuda_is_said_to_be_slow_once(monkeypatch):
    """int4 has no CUDA kernel here (measured 0.3x bf16 on an H100): a layer placed on CUDA
    warns once per process. The placement goes through the same install as any device off the
    CPU, seen here with the meta device; the warning itself only for CUDA."""
    from lucidlm.quantization import int4

    placed = []
    monkeypatch.setattr(int4, "note_cuda_int4", lambda device: placed.append(device.type))
    layer = Int4Linear.from_float(torch.nn.Linear(64, 16), 32)
    layer.to("meta")
    assert placed == ["meta"]
    monkeypatch.undo()

    monkeypatch.setattr(int4, "_cuda_noted", False)
    with pytest.warns(UserWarning, match=r"int4 layers on CUDA run without a fused kernel.*quantize='int8'"):
        assert int4.note_cuda_int4(torch.device("cuda", 0))
    assert not int4.note_cuda_int4(torch.device("cuda", 0))  # once
    monkeypatch.setattr(int4, "_cuda_noted", False)
    assert not int4.note_cuda_int4(torch.device("cpu")) and not int4.note_cuda_int4(torch.device("meta"))


@pytest.mark.parametrize("width", [72, 100, 48])
def test_int8_per_channel_on_widths_torchs_kernel_cannot_read(width):
    """torch's _weight_int8pack_mm reads the input width in blocks of 16: at 72 or 100 it
    gave garbage with one row and crashed the process (SIGSEGV) with several, so those widths
    take the plain path. Every row count equals x @ W.T of the NumPy reference's weight."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(width, 40, bias=False)
    layer = Int8Linear.from_float(linear, None)
    w = ref_int8(linear.weight.detach().numpy(), None)
    for rows in (1, 2, 8, 17):
        x = torch.randn(rows, width).to(torch.bfloat16)
        expected = x.float().numpy() @ w.T
        got = layer(x).float().numpy()
        assert np.abs(got - expected).max() <= 0.02 * np.abs(expected).max()


def test_int4_group_sizes_are_the_kernels():
    model = tiny_llama()
    with pytest.raises(QuantizationError, match=r"int4 takes groups of 32, 64, 128, 256 .* not 16"):
        quantize(model, "int4", group_size=16)
    assert type(model.blocks[0].attn.q_proj) is torch.nn.Linear  # refused before anything changed


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_non_finite_weights_are_refused_before_anything_changes(scheme):
    """One NaN or inf would spread over its whole group of codes (and the logits)."""
    for bad in (float("nan"), float("inf")):
        model = tiny_llama()
        with torch.no_grad():
            model.blocks[1].mlp.down_proj.weight[3, 5] = bad
        with pytest.raises(QuantizationError, match=r"blocks\.1\.mlp\.down_proj: the weight holds 1 NaN or infinite"):
            quantize(model, scheme)
        assert type(model.blocks[0].attn.q_proj) is torch.nn.Linear


def test_int4_of_huge_finite_weights_stays_finite():
    """max - min of +-3e38 overflows float32; the scale (max - min) / 15 does not."""
    w = torch.full((4, 32), 3e38)
    w[:, ::2] = -3e38
    plain = Int4Linear.quantize_weight(w, 32)
    weight = Int4Linear.dequantize_plain(plain, 32)
    assert torch.isfinite(weight).all()
    assert torch.allclose(weight, w, rtol=0.02)


def test_quantizing_twice_is_refused():
    model = quantize(tiny_llama(), "int8")
    with pytest.raises(QuantizationError, match=r"already holds quantized weights \(int8, per channel\)"):
        quantize(model, "int4")
    assert isinstance(model.blocks[0].attn.q_proj, Int8Linear)
