"""A block's decode step in one C++ call (model/decode_block.py, ``torch.ops.lucidlm.decode_block``)
against the modules it stands in for (model/block.py with the switch off): the same logits and
the same KV cache bit for bit, on random models of several shapes and on the embedded default;
and the modules, not the call, wherever anything could tell the difference (hooks, flags, LoRA,
prefixes, autograd, other dtypes)."""

from __future__ import annotations

import pytest
import torch

from lucidlm.config import ModelConfig
from lucidlm.language_model import LanguageModel
from lucidlm.model.fused import fuse_projections
from lucidlm.quantization import blocks_kernel, quantize


@pytest.fixture(autouse=True, scope="module")
def kernels_loaded():
    # built by scripts/install.sh on CI's machines (AVX-512 VNNI or AVX2): test_blocks_kernel.py says so
    assert blocks_kernel.available(), blocks_kernel.unavailable_reason()


def int4_model(seed: int = 0, scheme: str = "int4", fuse: bool = True, **overrides) -> LanguageModel:
    """A random model in int4 (or int8) groups of 32 on lucidlm's kernels, q/k/v and gate/up
    fused (or not) and switched on as ``lucidlm.load`` leaves the embedded default."""
    torch.manual_seed(seed)
    shape = dict(vocab_size=48, d_model=64, n_layers=3, n_heads=4, n_kv_heads=2, max_seq_len=96, positions="rope",
                 norm="rms", mlp="swiglu", d_mlp=96, tie_embeddings=False)
    model = LanguageModel(ModelConfig(**{**shape, **overrides})).eval()
    with torch.no_grad():  # weights big enough that the layers matter, norms that are not all ones
        for p in model.parameters():
            p.normal_(0, 0.3) if p.dim() == 2 else p.uniform_(0.5, 1.5)
    quantize(model, scheme, group_size=32, embeddings=False)
    if fuse:  # int8 layers have no fused form: they stay one matmul each
        assert fuse_projections(model) == (2 * len(model.blocks) if scheme == "int4" else 0)
    assert blocks_kernel.use_cpu_loops(model)
    assert all(block.decode_kernel for block in model.blocks)
    return model


def switch(model: LanguageModel, on: bool) -> None:
    for block in model.blocks:
        block.decode_kernel = on


class Calls(list):
    """x's shape once for each block the C++ step computed, through ``decode_block`` (one block)
    or ``decode_stack`` (all of them); ``stacks``: the number of blocks of each decode_stack call."""

    stacks: list[int]


def counted(monkeypatch) -> Calls:
    calls, block_op, stack_op = Calls(), torch.ops.lucidlm.decode_block, torch.ops.lucidlm.decode_stack
    calls.stacks = []

    def stack(*args):
        n_blocks = len(args[8])  # one k cache a block
        calls.extend([args[0].shape] * n_blocks)
        calls.stacks.append(n_blocks)
        return stack_op(*args)

    monkeypatch.setattr(torch.ops.lucidlm, "decode_block", lambda *args: calls.append(args[0].shape) or block_op(*args))
    monkeypatch.setattr(torch.ops.lucidlm, "decode_stack", stack)
    return calls


def decode(model: LanguageModel, prompts: list[list[int]], steps: int = 12,
           ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Left-padded prompts, a prefill and ``steps`` greedy decode steps through ``model.step``:
    every step's last logits (steps + 1, B, vocab) and the caches it leaves."""
    B, T = len(prompts), max(map(len, prompts))
    ids = torch.zeros(B, T, dtype=torch.long)
    real = torch.zeros(B, T + steps, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, T - len(prompt):] = torch.tensor(prompt)
        real[row, T - len(prompt):] = 1
    model.setup_kv_cache(B, T + steps + 4)
    out = []
    with torch.no_grad():
        logits = model.step(ids, torch.arange(T), real[:, :T], last_token_only=True, new_cache=True)[:, -1]
        out.append(logits)
        for i in range(steps):
            step_mask = torch.cat([real, torch.zeros(B, 4, dtype=torch.long)], dim=1)
            step_mask[:, T + i + 1:] = 0
            logits = model.step(logits.argmax(-1, keepdim=True), torch.tensor([T + i]), step_mask)[:, -1]
            out.append(logits)
    caches = [t.clone() for cache in model.kv_caches for t in (cache.k, cache.v)]
    model.clear_kv_cache()
    return torch.stack(out), caches


def assert_same_bits(got, want) -> None:
    (got_logits, got_caches), (want_logits, want_caches) = got, want
    assert torch.equal(got_logits, want_logits), (got_logits - want_logits).abs().max()
    assert all(torch.equal(a, b) for a, b in zip(got_caches, want_caches))


PROMPTS = [[1, 5, 9, 2, 7, 3, 11], [4, 4, 8], [30, 2, 17, 9, 9]]


@pytest.mark.parametrize("overrides", [
    {},  # grouped-query, RoPE "half" (Hugging Face's layout)
    {"rope_variant": "interleaved"},  # GGUF / Meta's layout
    {"n_kv_heads": 1},  # multi-query
    {"n_kv_heads": 4},  # one kv head per query head
    {"n_heads": 2, "n_kv_heads": 2, "rope_theta": 500000.0},  # head_dim 32
    {"sliding_window": 4, "n_layers": 4},  # local layers get their own mask
    {"qk_norm": True},  # Qwen 3: RMSNorm over each head's query and key
    # Gemma 3: sandwich norms, q/k norms, GeGLU, its own score scale, local and global layers
    {"qk_norm": True, "post_sublayer_norm": True, "mlp": "geglu", "query_pre_attn_scalar": 24.0,
     "sliding_window": 4, "n_layers": 4},
    {"scheme": "int8"},  # q/k/v and gate/up one matmul each
    {"fuse": False},  # int4 layers not fused
    {"scheme": "int8", "fuse": False, "qk_norm": True, "post_sublayer_norm": True, "mlp": "geglu"},
])
@pytest.mark.parametrize("rows", [1, 3])
def test_equals_the_modules_bit_for_bit(monkeypatch, overrides, rows):
    model = int4_model(**overrides)
    calls = counted(monkeypatch)
    got = decode(model, PROMPTS[:rows])
    assert calls == [(rows, 1, 64)] * (12 * len(model.blocks))  # every decode step of every block; not the prefill
    assert calls.stacks == [len(model.blocks)] * 12  # all the blocks of a step in one call
    switch(model, False)
    calls.clear()
    want = decode(model, PROMPTS[:rows])
    assert calls == []
    assert_same_bits(got, want)


def decode_chunks(model: LanguageModel, prompts: list[list[int]], chunks: list[int], seed: int = 1,
                  ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Left-padded prompts, a prefill, then fixed random tokens fed ``chunks[i]`` at a time
    through ``model.step`` (as speculative decoding checks its drafts): the final norm's output
    after every token fed (B, sum(chunks), d) and the caches it leaves. (Not the logits: this
    model's unembedding is a float32 ``F.linear``, whose sums depend on how many rows it gets.)"""
    B, T, n = len(prompts), max(map(len, prompts)), sum(chunks)
    ids = torch.zeros(B, T, dtype=torch.long)
    real = torch.zeros(B, T + n + 4, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, T - len(prompt):] = torch.tensor(prompt)
        real[row, T - len(prompt):] = 1
    tokens = torch.randint(0, 48, (B, n), generator=torch.Generator().manual_seed(seed))
    model.setup_kv_cache(B, T + n + 4)
    out, at = [], T
    with torch.no_grad():
        model.step(ids, torch.arange(T), real[:, :T], new_cache=True)
        handle = model.ln_final.register_forward_hook(lambda module, args, output: out.append(output))
        for chunk in chunks:
            fed = tokens[:, at - T:at - T + chunk]
            model.step(fed, torch.arange(at, at + chunk), real)
            at += chunk
        handle.remove()
    caches = [t.clone() for cache in model.kv_caches for t in (cache.k, cache.v)]
    model.clear_kv_cache()
    return torch.cat(out, dim=1), caches


@pytest.mark.parametrize("overrides", [
    {},
    {"rope_variant": "interleaved"},
    {"n_kv_heads": 1},
    {"sliding_window": 4, "n_layers": 4},
    {"qk_norm": True, "post_sublayer_norm": True, "mlp": "geglu", "query_pre_attn_scalar": 24.0,
     "sliding_window": 4, "n_layers": 4},
    {"scheme": "int8", "fuse": False},
])
@pytest.mark.parametrize("rows", [1, 3])
def test_a_few_tokens_in_one_call_are_as_many_one_token_steps_bit_for_bit(monkeypatch, overrides, rows):
    """Speculative decoding's checking pass (T tokens a row, one call) gives every token's
    stream and cache slot exactly as T plain decode steps would, so its greedy tokens are plain
    greedy's; and those steps are the modules' bit for bit (the test above). (The modules'
    own T-token pass is not a bitwise reference: it attends through SDPA, and a last-bit
    difference can move an int8 activation code, 2e-3 on this random model.)"""
    model = int4_model(**overrides)
    calls = counted(monkeypatch)
    chunks = [5, 1, 3, 2, 7]
    got = decode_chunks(model, PROMPTS[:rows], chunks)
    assert calls.stacks == [len(model.blocks)] * len(chunks)
    assert [shape[1] for shape in calls[::len(model.blocks)]] == chunks
    calls.clear()
    one_by_one = decode_chunks(model, PROMPTS[:rows], [1] * sum(chunks))
    assert calls == [(rows, 1, 64)] * (sum(chunks) * len(model.blocks))
    assert_same_bits(got, one_by_one)


def test_more_tokens_than_one_call_takes_get_the_modules(monkeypatch):
    from lucidlm.model.decode_block import MAX_TOKENS

    model = int4_model(max_seq_len=MAX_TOKENS + 16)
    calls = counted(monkeypatch)
    decode_chunks(model, PROMPTS[:1], [MAX_TOKENS + 1])
    assert calls == []
    got = decode_chunks(model, PROMPTS[:1], [MAX_TOKENS])
    assert calls == [(1, MAX_TOKENS, 64)] * len(model.blocks)
    assert_same_bits(got, decode_chunks(model, PROMPTS[:1], [1] * MAX_TOKENS))


def test_fewer_rows_than_the_cache_holds_get_the_modules(monkeypatch):
    """A pass of 1 row on a cache set up for 3 (``KVCache.update`` writes its first rows, as
    beam search's prompt does): the modules run, with their result, where the C++ call would
    refuse the shapes."""
    model = int4_model()
    calls = counted(monkeypatch)

    def run() -> torch.Tensor:
        model.setup_kv_cache(3, 32)
        with torch.no_grad():
            model.step(torch.tensor([[1, 5, 9]]), torch.arange(3), new_cache=True)
            return model.step(torch.tensor([[7, 2]]), torch.arange(3, 5))

    got = run()
    assert calls == []
    switch(model, False)
    assert torch.equal(got, run())


def test_generate_and_the_embedded_default_give_the_same_tokens(monkeypatch):
    import lucidlm
    from lucidlm.generation import generate_batch

    model = lucidlm.load()  # Q4_1 layers on lucidlm's kernels: the loader switches it on
    assert all(block.decode_kernel for block in model.blocks)
    prompts = [model.tokenizer.encode("The capital of France is"), model.tokenizer.encode("def fib(n):")]
    calls = counted(monkeypatch)
    got = generate_batch(model, prompts, max_new_tokens=16, temperature=0, stop_on_eos=False)
    assert len(calls) == 15 * len(model.blocks)
    got_logits = decode(model, prompts, steps=6)
    switch(model, False)
    want = generate_batch(model, prompts, max_new_tokens=16, temperature=0, stop_on_eos=False)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert_same_bits(got_logits, decode(model, prompts, steps=6))
    assert not any(block.decode_kernel for block in lucidlm.load(dtype="float32").blocks)  # the exact float path


def test_the_gemma3_file_kept_quantized_gives_the_same_bits(monkeypatch, gemma3_gguf):
    import lucidlm

    model = lucidlm.load("gemma3-270m", quantize="gguf")  # its K-quants as int4 and int8 groups of 32, apart
    assert all(block.decode_kernel for block in model.blocks)
    prompts = [model.tokenizer.encode("The capital of France is"), model.tokenizer.encode("def fib(n):")]
    calls = counted(monkeypatch)
    got = decode(model, prompts, steps=4)
    assert len(calls) == 4 * len(model.blocks) and calls.stacks == [len(model.blocks)] * 4  # local and global layers
    switch(model, False)
    assert_same_bits(got, decode(model, prompts, steps=4))


def test_a_hook_inside_the_block_gets_the_modules_and_sees_its_values(monkeypatch):
    model = int4_model()
    calls = counted(monkeypatch)
    for name in ("blocks.1.attn.hook_rot_k", "blocks.0.mlp.hook_post", "blocks.2.ln2.hook_scale",
                 "blocks.1.hook_resid_mid"):
        seen = []
        point = model.hook_points()[name]
        point.add_hook(lambda t, hook: seen.append(t.clone()))
        got = decode(model, PROMPTS)
        assert len(seen) == 13  # the prefill and every decode step ran the module with the hook
        assert len(calls) == 12 * (len(model.blocks) - 1) and all(c == (3, 1, 64) for c in calls)  # the others took it
        assert calls.stacks == []  # one by one: the hooked block runs its modules
        switch(model, False)
        seen_by_modules = []
        point.fns[0] = lambda t, hook: seen_by_modules.append(t.clone())
        want = decode(model, PROMPTS)
        point.remove_hooks()
        switch(model, True)
        # (a hook on a norm's scale has it spelled out, in other sums: the same either way)
        assert_same_bits(got, want)
        assert all(torch.equal(a, b) for a, b in zip(seen, seen_by_modules))
        calls.clear()


def test_an_editing_hook_changes_the_output_as_it_does_through_the_modules():
    model = int4_model()
    point = model.hook_points()["blocks.1.hook_mlp_out"]
    point.add_hook(lambda t, hook: t * 0.5)
    got = decode(model, PROMPTS)
    switch(model, False)
    assert_same_bits(got, decode(model, PROMPTS))
    point.remove_hooks()
    assert not torch.equal(got[0], decode(model, PROMPTS)[0])


def test_run_with_cache_leaves_no_trace(monkeypatch):
    model = int4_model()
    model.run_with_cache(torch.tensor([[1, 2, 3]]))  # attaches and detaches a hook at every point
    calls = counted(monkeypatch)
    decode(model, PROMPTS[:1])
    assert len(calls) == 12 * len(model.blocks)


def test_torch_hooks_on_the_replaced_modules_get_the_modules_and_on_the_block_see_the_call(monkeypatch):
    model = int4_model()
    want = decode(model, PROMPTS)
    calls = counted(monkeypatch)
    block = model.blocks[0]
    for module in (block.attn.o_proj, block.ln1, block.mlp, block.attn.fused_qkv):
        seen = []
        handle = module.register_forward_hook(lambda m, args, out: seen.append(1))
        got = decode(model, PROMPTS)
        handle.remove()
        assert seen and len(calls) == 12 * (len(model.blocks) - 1)
        assert_same_bits(got, want)
        calls.clear()
    outputs = []
    handle = block.register_forward_hook(lambda m, args, out: outputs.append(out.clone()))
    got = decode(model, PROMPTS)
    handle.remove()
    assert len(calls) == 12 * len(model.blocks) and len(outputs) == 13  # the block's own hook wraps the call
    assert calls.stacks == []  # so that block is called on its own
    assert_same_bits(got, want)


@pytest.mark.parametrize("option", ["attn_result", "split_qkv_input", "mlp_in"])
def test_opt_in_hook_sites_get_the_modules(monkeypatch, option):
    from lucidlm.model.hook_options import set_hook_options

    model = int4_model()
    before = decode(model, PROMPTS)
    set_hook_options(model, **{option: True})
    calls = counted(monkeypatch)
    got = decode(model, PROMPTS)
    assert calls == []
    switch(model, False)
    assert_same_bits(got, decode(model, PROMPTS))
    switch(model, True)
    set_hook_options(model, **{option: False})
    assert_same_bits(decode(model, PROMPTS), before)
    assert len(calls) == 12 * len(model.blocks)


def test_the_explicit_attention_path_gets_the_modules(monkeypatch):
    model = int4_model()
    for block in model.blocks:
        block.attn.use_explicit = True
    calls = counted(monkeypatch)
    got = decode(model, PROMPTS)
    assert calls == []
    switch(model, False)
    assert_same_bits(got, decode(model, PROMPTS))


class Wrapped(torch.nn.Module):
    """A module put in a layer's place, as a user's patch or a PEFT wrapper would be."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x) * 2


@pytest.mark.parametrize("parent_name, child", [("attn", "o_proj"), ("mlp", "down_proj"), ("attn", "q_proj"),
                                                 ("mlp", "up_proj"), ("", "ln2")])
def test_a_replaced_layer_gets_the_modules(monkeypatch, parent_name, child):
    model = int4_model()
    want = decode(model, PROMPTS)
    parent = model.blocks[1].get_submodule(parent_name)
    original = getattr(parent, child)
    setattr(parent, child, Wrapped(original))
    calls = counted(monkeypatch)
    got = decode(model, PROMPTS)
    assert len(calls) == 12 * (len(model.blocks) - 1)  # block 1 ran its modules, with the wrapper
    assert not torch.equal(got[0], want[0])
    switch(model, False)
    assert_same_bits(got, decode(model, PROMPTS))
    setattr(parent, child, original)
    switch(model, True)
    assert_same_bits(decode(model, PROMPTS), want)


def test_a_block_of_its_own_class_or_forward_is_called_and_the_others_take_the_one_block_call(monkeypatch):
    from lucidlm.model.block import Block

    class Doubled(Block):  # a user's block: its own forward, around the block's
        def forward(self, x, *args, **kwargs):
            return super().forward(x, *args, **kwargs) * 2

    model = int4_model()
    want = decode(model, PROMPTS)
    calls = counted(monkeypatch)
    block = model.blocks[1]
    block.__class__ = Doubled
    got = decode(model, PROMPTS)
    assert calls.stacks == [] and len(calls) == 12 * len(model.blocks)  # Block.forward still takes one_call_step
    assert not torch.equal(got[0], want[0])
    switch(model, False)
    assert_same_bits(got, decode(model, PROMPTS))
    switch(model, True)
    block.__class__ = Block
    block.forward = lambda *args: Block.forward(block, *args) * 2  # a patch on the instance
    calls.clear()
    assert_same_bits(decode(model, PROMPTS), got)
    assert calls.stacks == []
    del block.forward
    calls.clear()
    assert_same_bits(decode(model, PROMPTS), want)
    assert calls.stacks == [len(model.blocks)] * 12


def test_autograd_and_bfloat16_get_the_modules(monkeypatch):
    model = int4_model()
    calls = counted(monkeypatch)
    model.setup_kv_cache(1, 16)
    model.step(torch.tensor([[1, 2, 3]]), torch.arange(3), new_cache=True)
    with torch.enable_grad():
        model.step(torch.tensor([[4]]), torch.tensor([3]))
    assert calls == []
    with torch.no_grad():
        model.step(torch.tensor([[4]]), torch.tensor([3]))
    assert len(calls) == len(model.blocks)


def test_bad_inputs_are_refused_by_name():
    model = int4_model()
    model.setup_kv_cache(1, 16)
    block, cache = model.blocks[0], model.kv_caches[0]
    x = torch.randn(1, 1, 64)
    cos, sin = torch.ones(1, 1, 1, 16), torch.zeros(1, 1, 1, 16)
    mask = torch.ones(1, 1, 1, 16, dtype=torch.bool)
    from lucidlm.model.decode_block import _plan
    attn, ln1, q_norm, k_norm, ln1_post, ln2, ln2_post, qkv, o, gate_up, activation, down = _plan(block)
    assert (q_norm, k_norm, ln1_post, ln2_post, activation) == (None, None, None, None, 0) and len(qkv) == 3

    def call(x=x, slot=torch.tensor([2]), k=cache.k, mask=mask, qkv=qkv, n_heads=4, q_norm=None, activation=0,
             gate_up=gate_up, cos=cos, sin=sin):
        return torch.ops.lucidlm.decode_block(x, ln1.weight, 1e-5, qkv, q_norm, None, 1e-6, cos, sin, False, k, cache.v,
                                              slot, mask, 0.25, n_heads, o, None, 0.0, ln2.weight, 1e-5, gate_up,
                                              activation, down, None, 0.0)

    assert call().shape == (1, 1, 64)
    with pytest.raises(RuntimeError, match="input_pos must be 2 int64 slots, one a token"):
        call(x=torch.randn(1, 2, 64))
    with pytest.raises(RuntimeError, match="x must be \\(B, T, D\\) float32"):
        call(x=x.double())
    with pytest.raises(RuntimeError, match="slot 16 is outside the cache's 16 slots"):
        call(x=torch.randn(1, 2, 64), slot=torch.tensor([15, 16]))
    two = dict(x=torch.randn(1, 2, 64), slot=torch.tensor([2, 3]))
    with pytest.raises(RuntimeError, match="cos and sin must be float32 \\(B, T, 1, hd\\) = \\(1, 2, 1, 16\\)"):
        call(**two)  # one token's rotation
    with pytest.raises(RuntimeError, match="mask must be \\(B or 1, 1, 2, 16\\) bool"):
        call(**two, cos=torch.ones(1, 2, 1, 16), sin=torch.zeros(1, 2, 1, 16))  # one query row
    assert call(**two, cos=torch.ones(1, 2, 1, 16), sin=torch.zeros(1, 2, 1, 16),
                mask=torch.ones(1, 1, 2, 16, dtype=torch.bool)).shape == (1, 2, 64)
    with pytest.raises(RuntimeError, match="slot 16 is outside the cache's 16 slots"):
        call(slot=torch.tensor([16]))
    with pytest.raises(RuntimeError, match="slot -1 is outside"):
        call(slot=torch.tensor([-1]))
    with pytest.raises(RuntimeError, match="caches must be contiguous float32"):
        call(k=cache.k.bfloat16())
    with pytest.raises(RuntimeError, match="mask must be"):
        call(mask=torch.ones(1, 1, 1, 15, dtype=torch.bool))
    with pytest.raises(RuntimeError, match="the fused q/k/v gives 128 outputs, the heads need 96"):
        call(n_heads=2)
    with pytest.raises(RuntimeError, match="the fused q/k/v reads 96 inputs"):
        call(qkv=down)
    with pytest.raises(RuntimeError, match="qkv takes 3 or 9 tensors"):
        call(qkv=qkv[:2])
    with pytest.raises(RuntimeError, match="q_norm's weight must be a contiguous float32 \\(16,\\)"):
        call(q_norm=torch.ones(64))
    with pytest.raises(RuntimeError, match="activation must be 0 \\(silu\\) or 1"):
        call(activation=2)
    with pytest.raises(RuntimeError, match="gate_proj gives 192 outputs, up_proj 64"):
        call(gate_up=gate_up + o)


def test_bad_stack_inputs_are_refused_by_name():
    model = int4_model(n_layers=2)
    model.setup_kv_cache(1, 16)
    from lucidlm.model.decode_block import _plan
    x = torch.randn(1, 1, 64)
    cos, sin = torch.ones(1, 1, 1, 16), torch.zeros(1, 1, 1, 16)
    mask = torch.ones(1, 1, 1, 16, dtype=torch.bool)
    plans = [_plan(block) for block in model.blocks]
    matmuls = [t for plan in plans for part in (plan[7], plan[8], plan[9], plan[11]) for t in part]

    def call(norms=None, counts=(3, 3, 3, 3) * 2, floats=(1e-5, 0.0, 0.25, 0.0, 1e-5, 0.0) * 2, slot=2,
             k_caches=None):
        norms = norms if norms is not None else [t for plan in plans for t in (plan[1].weight, plan[5].weight)]
        k_caches = k_caches if k_caches is not None else [cache.k for cache in model.kv_caches]
        return torch.ops.lucidlm.decode_stack(x, norms, [None] * 8, matmuls, list(counts), [cos] * 2, [sin] * 2,
                                              [mask] * 2, k_caches, [cache.v for cache in model.kv_caches],
                                              torch.tensor([slot]), list(floats), [0, 4, 0] * 2)

    assert call().shape == (1, 1, 64)
    with pytest.raises(RuntimeError, match="for 2 layers .* 6 floats and 3 ints a layer; got 2, 8, 8"):
        call(norms=[plans[0][1].weight, plans[0][5].weight])
    with pytest.raises(RuntimeError, match="the matmul counts add up to 27 tensors, 24 given"):
        call(counts=(3, 3, 3, 3, 3, 3, 3, 6))
    with pytest.raises(RuntimeError, match="layer 0: decode_block: slot 16 is outside the cache's 16 slots"):
        call(slot=16)
    with pytest.raises(RuntimeError, match="layer 1: decode_block: the caches must be contiguous float32"):
        call(k_caches=[model.kv_caches[0].k, model.kv_caches[1].k.bfloat16()])
    with pytest.raises(RuntimeError, match="layer 1: decode_block: ln2's weight must be a contiguous float32"):
        call(norms=[plans[0][1].weight, plans[0][5].weight, plans[1][1].weight, torch.ones(63)])


def plan_lookups(monkeypatch) -> list:
    """One entry each time the stack's operands are looked up (``decode_block._stack_plan``)."""
    import lucidlm.model.decode_block as decode_block

    looked_up, real = [], decode_block._stack_plan
    monkeypatch.setattr(decode_block, "_stack_plan", lambda *args: looked_up.append(1) or real(*args))
    return looked_up


def test_a_steady_run_looks_the_stack_up_once_with_the_same_bits(monkeypatch):
    from lucidlm.generation import generate_batch

    model = int4_model()
    looked_up, calls = plan_lookups(monkeypatch), counted(monkeypatch)
    with model.steady_decode():
        got = decode(model, PROMPTS)
    assert len(looked_up) == 1 and calls.stacks == [len(model.blocks)] * 12
    looked_up.clear()
    assert_same_bits(decode(model, PROMPTS), got)  # model.step outside: every step looks again
    assert len(looked_up) == 12
    switch(model, False)
    assert_same_bits(got, decode(model, PROMPTS))
    switch(model, True)
    looked_up.clear()
    tokens = [r.token_ids for r in generate_batch(model, PROMPTS, max_new_tokens=9, temperature=0, stop_on_eos=False)]
    assert len(looked_up) == 1 and model._steady is None  # generate's own loop runs steady; it ends with the call
    assert tokens == [[int(t) for t in column] for column in got[0][:9].argmax(-1).T]


def test_a_steady_run_looks_again_after_a_hook_point_or_new_caches_and_not_at_all_with_a_listener(monkeypatch):
    model = int4_model()
    looked_up, calls = plan_lookups(monkeypatch), counted(monkeypatch)
    ids = torch.tensor([[1, 5, 9]])
    seen = []
    with torch.no_grad(), model.steady_decode():
        model.setup_kv_cache(1, 16)
        model.step(ids, torch.arange(3), new_cache=True)
        for slot in (3, 4):
            model.step(torch.tensor([[2]]), torch.tensor([slot]))
        assert len(looked_up) == 1 and calls.stacks == [3, 3]
        point = model.hook_points()["blocks.1.attn.hook_rot_k"]
        point.add_hook(lambda t, hook: seen.append(t.clone()))
        model.step(torch.tensor([[2]]), torch.tensor([5]))
        assert len(looked_up) == 2 and len(seen) == 1 and calls.stacks == [3, 3]  # block 1 ran its modules
        point.remove_hooks()
        model.step(torch.tensor([[2]]), torch.tensor([6]))
        assert len(looked_up) == 3 and calls.stacks == [3, 3, 3]
        model.setup_kv_cache(1, 16)  # new caches: the kept operands name the old ones
        model.step(ids, torch.arange(3), new_cache=True)
        model.step(torch.tensor([[2]]), torch.tensor([3]))
        assert len(looked_up) == 4 and calls.stacks == [3, 3, 3, 3]
    handle = model.embed.register_forward_hook(lambda m, args, out: seen.append(out))
    looked_up.clear()
    with torch.no_grad(), model.steady_decode():  # a listener: its code may change the model
        assert model._steady is None
        model.step(torch.tensor([[2]]), torch.tensor([4]))
        model.step(torch.tensor([[2]]), torch.tensor([5]))
    handle.remove()
    assert len(looked_up) == 2  # every step looked again


def test_a_stream_is_not_steady_so_a_hook_added_between_tokens_runs(monkeypatch):
    import lucidlm

    model = lucidlm.load()
    looked_up, seen = plan_lookups(monkeypatch), []
    pieces = model.stream("The capital of France is", max_new_tokens=8, temperature=0)
    for i, piece in enumerate(pieces):
        assert model._steady is None
        if i == 0:
            handle = model.blocks[3].mlp.register_forward_hook(lambda m, args, out: seen.append(1))
    handle.remove()
    assert seen and len(looked_up) >= len(seen)  # the hooked MLP ran at every step after it came


def test_a_stream_made_steady_looks_the_stack_up_once_and_says_the_same(monkeypatch):
    import lucidlm
    from lucidlm.errors import GenerationError

    model = lucidlm.load()
    looked_up = plan_lookups(monkeypatch)
    prompt = "The capital of France is"
    text = "".join(model.stream(prompt, max_new_tokens=8, temperature=0, steady=True))
    assert len(looked_up) == 1
    assert text == model.generate(prompt, max_new_tokens=8, temperature=0).text
    with pytest.raises(GenerationError, match="steady must be True or False, got 'yes'"):
        model.stream(prompt, steady="yes")


STREAM_OPTIONS = dict(max_new_tokens=10, temperature=0, stop_on_eos=False)


def model_with_tokenizer() -> LanguageModel:
    """A tiny int4 model on lucidlm's kernels, with a byte tokenizer so it can stream text."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).parents[1] / "generation"))
    from generation_toys import byte_tokenizer

    model = int4_model(vocab_size=257)
    model.tokenizer = byte_tokenizer()
    return model


def hooked_stream(model: LanguageModel) -> int:
    """Steps the MLP of block 1 ran in during a plain stream, with a hook attached after its third piece."""
    seen, handle = [], None
    for i, _ in enumerate(model.stream("Hello there", **STREAM_OPTIONS)):
        if i == 2:
            handle = model.blocks[1].mlp.register_forward_hook(lambda m, args, out: seen.append(1))
    handle.remove()
    return len(seen)


def test_steady_streams_closed_out_of_order_leave_nothing_steady_behind(monkeypatch):
    """The first stream's close restored nothing and the second's restored the first one's dict,
    so the model stayed steady: a plain stream afterwards kept its operands and skipped a hook
    attached between its tokens. Oracle: the same hooked stream on a fresh model."""
    model = model_with_tokenizer()
    first = model.stream("Hello there", steady=True, **STREAM_OPTIONS)
    next(first)
    second = model.stream("Hi", steady=True, **STREAM_OPTIONS)
    next(second)
    first.close()
    list(second)
    assert model._steady is None
    assert hooked_stream(model) == hooked_stream(model_with_tokenizer()) > 0


def test_a_plain_stream_after_a_paused_steady_one_runs_a_hook_added_between_its_tokens():
    """A steady stream left paused kept the model steady while a plain stream took its cache
    over: the plain stream decoded on kept operands, so a torch hook attached between its
    tokens was never called. Oracle: the same hooked stream on a fresh model."""
    model = model_with_tokenizer()
    paused = model.stream("Hi", steady=True, **STREAM_OPTIONS)
    next(paused)
    assert hooked_stream(model) == hooked_stream(model_with_tokenizer()) > 0
    assert model._steady is None
    paused.close()
