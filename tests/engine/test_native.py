"""The CPU engine's C kernels: built once into the kernel folder, equal to torch's paths,
and a clear fallback where no compiler is found."""

from __future__ import annotations

import logging
import shutil

import pytest
import torch
import torch.nn.functional as F
from test_attention import HEAD_DIM, make_batch, reference

from distserve_engine import attention as attention_module
from distserve_engine import native, sampling
from distserve_engine.attention import build_metadata, paged_attention
from distserve_engine.model_config import ModelConfig
from distserve_engine.models import layers
from distserve_engine.models.layers import (
    ColumnParallelLinear,
    RMSNorm,
    RotaryEmbedding,
    transpose_for_cpu,
)
from distserve_engine.models.llama import LlamaMLP
from distserve_engine.parallel import ParallelState

needs_compiler = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                    reason="no C compiler on this machine")


def spy_on_kernel(monkeypatch, name: str):
    """`native.<name>()`'s kernel, and the list its calls' arguments are recorded in while
    the accessor hands out a wrapper of it."""
    kernel, calls = getattr(native, name)(), []
    monkeypatch.setattr(native, name, lambda: lambda *args: calls.append(args) or kernel(*args))
    return kernel, calls


@pytest.fixture(params=["this CPU's build", "the AVX2 build"])
def kernel_build(request, monkeypatch):
    """The kernels built for this CPU, and, where that build is AVX-512's, the AVX2 build
    too (the one a CPU without AVX-512 runs): each test taking it checks both."""
    if request.param == "the AVX2 build":
        if native.cpu_flags() != native.X86_LEVELS["AVX512"]:
            pytest.skip("this CPU's build is not AVX-512's: the other case runs its kernels")
        library = native.load_library(native.build(native.X86_LEVELS["AVX2"]))
        monkeypatch.setattr(native, "_library", lambda: library)
    return request.param


@needs_compiler
def test_the_c_kernel_is_built_once_into_the_kernel_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("DISTSERVE_KERNEL_DIR", str(tmp_path))
    monkeypatch.setattr(native, "_loaded", {})
    assert native.paged_decode() is not None
    built = list(tmp_path.glob("cpu_kernels-*.so"))
    assert len(built) == 1
    stamp = built[0].stat().st_mtime_ns
    assert native.build() == built[0] and built[0].stat().st_mtime_ns == stamp  # not rebuilt


def test_without_a_compiler_decode_falls_back_to_torch_and_says_why(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("DISTSERVE_KERNEL_DIR", str(tmp_path))  # nothing built there
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setattr(native, "_loaded", {})
    with caplog.at_level(logging.WARNING, logger="distserve_engine.native"):
        q, k, v, k_cache, v_cache, meta, full = make_batch([5, 2], [1, 1], seed=2)
        out = paged_attention(q, k, v, k_cache, v_cache, meta, HEAD_DIM**-0.5)
    assert "its C kernels are not available" in caplog.text and "no-such-cc" in caplog.text
    assert meta.buffers  # the torch path gathered the context
    torch.testing.assert_close(out[:1], reference(q[:1], full[0][0], full[0][1], 5),
                               atol=1e-5, rtol=1e-5)


@needs_compiler
@pytest.mark.parametrize("rows", [1, 7])
def test_rms_norm_in_c_matches_torch_on_rows_and_strided_views(rows, monkeypatch, kernel_build):
    _, calls = spy_on_kernel(monkeypatch, "rms_norm")
    torch.manual_seed(rows)
    norm = RMSNorm(576, 1e-5)
    norm.weight.data.normal_()
    fused = torch.randn(rows, 3 * 576) * 4  # a view of its middle third: rows 3*576 apart
    for x in (torch.randn(rows, 576), fused[:, 576:1152]):
        out = norm(x)
        assert out.is_contiguous() and out.shape == x.shape
        torch.testing.assert_close(out, F.rms_norm(x, (576,), norm.weight, 1e-5),
                                   atol=1e-5, rtol=1e-5)
    assert len(calls) == 2  # both through the C kernel


@needs_compiler
@pytest.mark.parametrize("rows", [1, 33])
@pytest.mark.parametrize("threads", [1, 2])  # one: packed to a contiguous matrix; two: in place
def test_swiglu_in_c_matches_silu_times_up(rows, threads, monkeypatch, kernel_build):
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    _, calls = spy_on_kernel(monkeypatch, "swiglu")
    torch.manual_seed(rows)
    # 44 intermediate features: five vectors of 8 floats, then a scalar tail of 4
    config = ModelConfig.from_hf({"architectures": ["LlamaForCausalLM"], "vocab_size": 10,
                                  "hidden_size": 64, "num_hidden_layers": 1,
                                  "num_attention_heads": 4, "intermediate_size": 44})
    mlp = LlamaMLP(config, ParallelState())
    for module in (mlp.gate_up_proj, mlp.down_proj):
        module.weight.data.normal_(0, 0.5)
    x = torch.randn(rows, 64) * 3
    x[0, :4] = torch.tensor([-200.0, 0.0, 1e-4, 90.0])  # the sigmoid's far ends and zero
    out = mlp(x)
    gate, up = F.linear(x, mlp.gate_up_proj.weight).chunk(2, dim=-1)
    expected = F.linear(F.silu(gate) * up, mlp.down_proj.weight)
    assert len(calls) == 1 and calls[0][4] == (threads == 1)  # through the C kernel
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-5)


@needs_compiler
def test_rotary_in_c_matches_the_torch_rotation_and_leaves_v_alone(monkeypatch):
    rotary = RotaryEmbedding(64, 4096, 10000.0, None)
    positions = torch.tensor([0, 1, 2, 4000, 7, 3])
    table = rotary.table(positions, torch.float32)
    qkv = torch.randn(6, (9 + 3 + 3) * 64)  # q's 9 heads, k's 3, then v's 3
    qk = qkv[:, : 12 * 64].view(6, 12, 64)
    expected = qk.clone()
    with native.torch_paths_only():
        RotaryEmbedding.rotate_(expected, table)
    _, calls = spy_on_kernel(monkeypatch, "rotary")
    v = qkv[:, 12 * 64:].clone()
    RotaryEmbedding.rotate_(qk, table)
    assert len(calls) == 1
    torch.testing.assert_close(qk, expected, atol=1e-6, rtol=1e-5)
    assert torch.equal(qkv[:, 12 * 64:], v)


@needs_compiler
def test_bf16_rms_norm_swiglu_and_rotary_in_c_round_once_what_float32_computes(monkeypatch,
                                                                              kernel_build):
    """bfloat16 in and out, float32 inside: each kernel's output is the float32 torch
    path's on the same bfloat16 inputs, rounded once to bfloat16 (within that rounding's
    last bit: the sums run in another order)."""
    one_rounding = {"atol": 0, "rtol": 2**-7}
    bf16 = torch.bfloat16
    torch.manual_seed(5)
    norm = RMSNorm(576, 1e-5).to(bf16)
    norm.weight.data.normal_()
    fused = (torch.randn(7, 3 * 576) * 4).to(bf16)
    config = ModelConfig.from_hf({"architectures": ["LlamaForCausalLM"], "vocab_size": 10,
                                  "hidden_size": 64, "num_hidden_layers": 1,
                                  "num_attention_heads": 4, "intermediate_size": 44})
    mlp = LlamaMLP(config, ParallelState()).to(bf16)
    for module in (mlp.gate_up_proj, mlp.down_proj):
        module.weight.data.normal_(0, 0.5)
    x = (torch.randn(9, 64) * 3).to(bf16)
    rotary = RotaryEmbedding(64, 4096, 10000.0, None)
    positions = torch.tensor([0, 1, 2, 4000, 7, 3])
    table = rotary.table(positions, bf16)
    qk = torch.randn(6, 12, 64).to(bf16)
    calls = {name: spy_on_kernel(monkeypatch, name)[1]
             for name in ("rms_norm_bf16", "swiglu_bf16", "rotary_bf16")}

    for rows in (fused[:, 576:1152], fused[:, :576].contiguous()):  # a strided view, and rows
        torch.testing.assert_close(norm(rows), F.rms_norm(
            rows.float(), (576,), norm.weight.float(), 1e-5).to(bf16), **one_rounding)
    gate, up = F.linear(x, mlp.gate_up_proj.weight).chunk(2, dim=-1)
    expected = F.linear((F.silu(gate.float()) * up.float()).to(bf16), mlp.down_proj.weight)
    torch.testing.assert_close(mlp(x), expected)
    rotated = qk.float()
    with native.torch_paths_only():
        RotaryEmbedding.rotate_(rotated, tuple(t.float() for t in table))
    RotaryEmbedding.rotate_(qk, table)
    torch.testing.assert_close(qk, rotated.to(bf16), **one_rounding)
    assert {name: len(c) for name, c in calls.items()} == {
        "rms_norm_bf16": 2, "swiglu_bf16": 1, "rotary_bf16": 1}


@needs_compiler
@pytest.mark.parametrize("width", [16, 37])  # whole vectors; and a tail past them
def test_bf16_swiglu_rounds_to_nearest_even_and_keeps_nans_and_infinities(width, kernel_build):
    torch.manual_seed(width)
    gate_up = (torch.randn(3, 2 * width) * 8).bfloat16()
    gate_up[0, :6] = torch.tensor([float("nan"), float("inf"), float("-inf"), 0.0, -0.0, 90.0])
    gate_up[1, width:width + 2] = torch.tensor([float("nan"), float("inf")])  # up's
    gate, up = gate_up.float().chunk(2, dim=-1)
    with torch.no_grad():
        expected = (F.silu(gate) * up).bfloat16()
    out = gate_up.clone()
    assert native.swiglu_bf16()(out.data_ptr(), out.stride(0), 3, width, 0, 1) == 0
    torch.testing.assert_close(out[:, :width], expected, atol=0, rtol=2**-7, equal_nan=True)
    assert torch.equal(out[:, width:].view(torch.int16), gate_up[:, width:].view(torch.int16))


def _loaded_linear(out_features: int, in_features: int, bias: bool, seed: int):
    """A float32 linear with random weights, laid out for the CPU as the loader leaves it,
    and the plain weight and bias to check it against."""
    torch.manual_seed(seed)
    weight = torch.randn(out_features, in_features) / in_features**0.5
    module = ColumnParallelLinear(in_features, [out_features], bias, ParallelState())
    module.weight.data.copy_(weight)
    if bias:
        module.bias.data.normal_()
    plain_bias = None if module.bias is None else module.bias.detach().clone()
    transpose_for_cpu(module)
    return module, weight, plain_bias


@needs_compiler
@pytest.mark.parametrize(("out_features", "in_features", "bias"),
                         [(960, 576, False), (50, 7, True), (16, 33, False), (17, 64, True)])
def test_packed_linear_in_c_matches_torch_at_decode_row_counts(out_features, in_features, bias,
                                                               monkeypatch, kernel_build):
    if native.pack_linear() is None:
        pytest.skip("this CPU lacks AVX2 and FMA: the linears keep torch's layouts")
    kernel, calls = native.packed_linear(), []
    monkeypatch.setattr(native, "packed_linear",
                        lambda: lambda *args: calls.append(args[2]) or kernel(*args))
    module, weight, plain_bias = _loaded_linear(out_features, in_features, bias, seed=out_features)
    assert getattr(module, "weight", None) is None  # replaced by its packed and blocked copies
    row_counts = [1, 2, 3, 5, 6, 7, 8, 13, 32, native.PACKED_MAX_ROWS, native.PACKED_MAX_ROWS + 1]
    for rows in row_counts:
        x = torch.randn(rows, in_features)
        torch.testing.assert_close(module(x), F.linear(x, weight, plain_bias), atol=1e-4, rtol=1e-4)
    assert calls == row_counts[:-1]  # more rows than PACKED_MAX_ROWS: oneDNN's blocked copy
    fused = torch.randn(5, 3 * in_features)  # a view of its middle third: rows 3 * in apart
    x = fused[:, in_features:2 * in_features]
    torch.testing.assert_close(module(x), F.linear(x, weight, plain_bias), atol=1e-4, rtol=1e-4)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the panels split between two OpenMP threads
    try:
        x = torch.randn(9, in_features)
        torch.testing.assert_close(module(x), F.linear(x, weight, plain_bias), atol=1e-4, rtol=1e-4)
    finally:
        torch.set_num_threads(threads)


@needs_compiler
def test_a_packed_linear_with_the_kernels_off_multiplies_by_its_blocked_copy():
    if native.pack_linear() is None:
        pytest.skip("this CPU lacks AVX2 and FMA: the linears keep torch's layouts")
    module, weight, plain_bias = _loaded_linear(40, 24, True, seed=3)
    x = torch.randn(4, 24)
    with native.torch_paths_only():
        out = module(x)
    torch.testing.assert_close(out, F.linear(x, weight, plain_bias), atol=1e-4, rtol=1e-4)


def test_without_the_packed_kernel_a_linear_keeps_its_in_out_copy(monkeypatch):
    monkeypatch.setattr(native, "pack_linear", lambda: None)  # as on a CPU without AVX2
    module, weight, plain_bias = _loaded_linear(40, 24, True, seed=4)
    assert getattr(module, "weight_packed", None) is None and module.weight_t.shape == (24, 40)
    for rows in (1, 2, 3, 8):
        x = torch.randn(rows, 24)
        torch.testing.assert_close(module(x), F.linear(x, weight, plain_bias), atol=1e-4, rtol=1e-4)


def _loaded_bf16_linear(out_features: int, in_features: int, seed: int):
    torch.manual_seed(seed)
    weight = (torch.randn(out_features, in_features) / in_features**0.5).bfloat16()
    module = ColumnParallelLinear(in_features, [out_features], True, ParallelState()).bfloat16()
    module.weight.data.copy_(weight)
    module.bias.data.normal_()
    plain_bias = module.bias.detach().clone()
    transpose_for_cpu(module)
    return module, weight, plain_bias


def _assert_bf16_product(module, weight, bias, rows: int):
    """The module's product: float32's on the same bfloat16 inputs, rounded once."""
    x = torch.randn(rows + 2, weight.shape[1]).bfloat16()[:rows]
    expected = F.linear(x.float(), weight.float(), bias.float()).bfloat16()
    torch.testing.assert_close(module(x), expected, atol=2**-6, rtol=2**-7)


def test_without_amx_a_bfloat16_linear_multiplies_every_row_count_by_its_blocked_copy(monkeypatch):
    if not layers._blocks_bfloat16():
        pytest.skip("oneDNN takes no bfloat16 blocked weights on this CPU")
    monkeypatch.setattr(native, "pack_linear_bf16", lambda: None)  # as on a CPU without AMX
    module, weight, bias = _loaded_bf16_linear(40, 24, seed=5)
    assert module.weight_blocked.is_mkldnn and module.blocked_min_rows == 1
    assert getattr(module, "weight_t", None) is None and getattr(module, "weight", None) is None
    assert layers.stored_weight(module) is module.weight_blocked
    for rows in (1, 2, 8, 33):
        _assert_bf16_product(module, weight, bias, rows)


@needs_compiler
@pytest.mark.parametrize(("out_features", "in_features"), [(40, 24), (37, 13), (960, 576), (70, 100)])
def test_a_bfloat16_linear_on_amx_multiplies_decode_rows_by_its_packed_copy(
        out_features, in_features, monkeypatch):
    if native.packed_linear_bf16() is None:
        pytest.skip("this CPU lacks AMX: bfloat16 linears keep oneDNN's blocked copy")
    _, calls = spy_on_kernel(monkeypatch, "packed_linear_bf16")
    module, weight, bias = _loaded_bf16_linear(out_features, in_features, seed=out_features)
    assert module.weight_packed.dtype == torch.bfloat16
    assert module.blocked_min_rows == native.PACKED_MAX_ROWS_BF16 + 1
    # one tile of rows, part of one, two, the 4-tile blocks, and past the packed kernel
    row_counts = (1, 3, 16, 17, 32, 33, 64, 65, 100)
    for rows in row_counts:
        _assert_bf16_product(module, weight, bias, rows)
    assert len(calls) == sum(rows <= native.PACKED_MAX_ROWS_BF16 for rows in row_counts)


@needs_compiler
def test_a_product_the_packed_kernel_refuses_runs_on_the_blocked_copy(monkeypatch):
    if native.packed_linear_bf16() is None:
        pytest.skip("this CPU lacks AMX: bfloat16 linears keep oneDNN's blocked copy")
    module, weight, bias = _loaded_bf16_linear(40, 24, seed=6)
    refusals = []
    monkeypatch.setattr(native, "packed_linear_bf16",
                        lambda: lambda *args: refusals.append(args) or -1)  # as out of memory
    _assert_bf16_product(module, weight, bias, 3)
    assert len(refusals) == 1


@needs_compiler
@pytest.mark.parametrize("cols", [1, 15, 16, 49152 + 7])
def test_row_argmax_in_c_is_torch_argmax_with_its_ties_infinities_and_nans(cols, monkeypatch):
    _, calls = spy_on_kernel(monkeypatch, "argmax_rows")
    torch.manual_seed(cols)
    x = torch.randn(6, cols + 3)[:, :cols]  # rows strided past their width
    x[1] = float("-inf")
    x[2, cols // 2:] = x[2].max() + 1  # ties: the first one wins
    x[3, -1] = float("inf")
    x[4, cols // 3] = float("nan")  # a NaN beats any number
    x[5, cols - 1] = float("nan")
    x[5, 0] = float("inf")
    assert sampling.row_argmax(x).tolist() == x.argmax(dim=-1).tolist()
    assert len(calls) == 1


@needs_compiler
@pytest.mark.parametrize(("lens", "num_heads", "num_kv_heads", "head_dim"), [
    ([5, 17, 1, 9], 9, 3, 64),  # SmolLM2's heads, lengths with partial tiles of 8 keys
    ([64, 64], 9, 3, 64),  # equal lengths: no padding either way
    ([7, 13], 4, 4, 16),  # one head per KV head: consecutive queries share a block
    ([7, 13, 2], 4, 2, 24),  # a group of 2, head_dim not a multiple of 32
    ([100, 3], 6, 1, 40),
])
def test_prefill_attention_in_c_matches_sdpa(lens, num_heads, num_kv_heads, head_dim, monkeypatch,
                                             kernel_build):
    torch.manual_seed(len(lens) + head_dim)
    num_tokens = sum(lens)
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim) * 2
    q = qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim: (num_heads + num_kv_heads) * head_dim].view(
        num_tokens, num_kv_heads, head_dim)
    v = qkv[:, (num_heads + num_kv_heads) * head_dim:].view(num_tokens, num_kv_heads, head_dim)
    tables = [list(range(-(-n // 16))) for n in lens]
    meta = build_metadata([0] * len(lens), lens, tables, 16, torch.device("cpu"))
    with native.torch_paths_only():
        expected = attention_module._attend_new(q, k, v, meta, head_dim**-0.5)  # SDPA
    _, calls = spy_on_kernel(monkeypatch, "prefill_attention")
    out = attention_module._attend_new(q, k, v, meta, head_dim**-0.5)
    assert len(calls) == 1 and out.shape == (num_tokens, num_heads * head_dim)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def _bf16_prefill_batch(lens, num_heads, num_kv_heads, head_dim, seed):
    """q, k, v (bfloat16 views of one fused qkv, as the model's projection gives them) and
    the metadata of a prefill of new sequences of these lengths."""
    torch.manual_seed(seed)
    num_tokens = sum(lens)
    qkv = (torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim) * 2).bfloat16()
    q = qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim: (num_heads + num_kv_heads) * head_dim].view(
        num_tokens, num_kv_heads, head_dim)
    v = qkv[:, (num_heads + num_kv_heads) * head_dim:].view(num_tokens, num_kv_heads, head_dim)
    tables = [list(range(-(-n // 16))) for n in lens]
    return q, k, v, build_metadata([0] * len(lens), lens, tables, 16, torch.device("cpu"))


@needs_compiler
@pytest.mark.parametrize(("lens", "num_heads", "num_kv_heads", "head_dim"), [
    ([5, 17, 1, 40], 9, 3, 64),  # SmolLM2's heads; partial blocks of queries and tiles of keys
    ([64, 64], 9, 3, 64),  # equal lengths
    ([300, 33], 8, 8, 128),  # one head per KV head, the widest head taken; keys past 4 tiles
    ([50, 2], 4, 2, 32),  # the narrowest head taken
])
def test_bf16_prefill_attention_on_amx_is_float32_attention_rounded(
        lens, num_heads, num_kv_heads, head_dim, monkeypatch):
    if native.prefill_attention_bf16() is None:
        pytest.skip("this CPU lacks AMX: a bfloat16 prefill attends with SDPA")
    q, k, v, meta = _bf16_prefill_batch(lens, num_heads, num_kv_heads, head_dim, seed=head_dim)
    with native.torch_paths_only():  # SDPA in float32 on the same bfloat16 inputs
        expected = attention_module._attend_new(q.float(), k.float(), v.float(), meta,
                                                head_dim**-0.5)
    _, calls = spy_on_kernel(monkeypatch, "prefill_attention_bf16")
    out = attention_module._attend_new(q, k, v, meta, head_dim**-0.5)
    assert len(calls) == 1 and out.dtype == torch.bfloat16
    assert out.shape == (sum(lens), num_heads * head_dim)
    # the softmax weights go to the tiles in bfloat16: a rounding or two from float32's
    torch.testing.assert_close(out.float(), expected, atol=2**-7, rtol=2**-6)


@needs_compiler
def test_bf16_prefill_attention_of_a_head_the_kernel_refuses_runs_sdpa(monkeypatch):
    if native.prefill_attention_bf16() is None:
        pytest.skip("this CPU lacks AMX: a bfloat16 prefill attends with SDPA")
    q, k, v, meta = _bf16_prefill_batch([9, 20], 4, 2, 80, seed=3)  # 80: not a multiple of 32
    with native.torch_paths_only():
        expected = attention_module._attend_new(q, k, v, meta, 80**-0.5)
    _, calls = spy_on_kernel(monkeypatch, "prefill_attention_bf16")
    out = attention_module._attend_new(q, k, v, meta, 80**-0.5)
    assert len(calls) == 1  # asked, refused (-2), and SDPA ran
    torch.testing.assert_close(out, expected, atol=0, rtol=0)


@needs_compiler
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [
    (9, 3, 64),  # SmolLM2's heads: 16-float vectors where the build is AVX-512's
    (4, 2, 24),  # a multiple of 8, not of 16: 8-float vectors on every x86 build
    (3, 1, 20),  # not a multiple of 8: the scalar loops
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_decode_in_c_matches_attention_over_each_sequences_blocks(
        num_heads, num_kv_heads, head_dim, dtype, kernel_build):
    torch.manual_seed(head_dim)
    block_size, num_blocks, lens = 16, 40, [1, 37, 100, 16]
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim).to(dtype)
    max_blocks = -(-max(lens) // block_size)
    tables = torch.randperm(num_blocks)[: len(lens) * max_blocks].view(len(lens), max_blocks)
    q = torch.randn(len(lens), num_heads, head_dim).to(dtype)
    out = torch.empty(len(lens), num_heads, head_dim, dtype=dtype)
    scale = head_dim**-0.5
    tables, context_lens = tables.contiguous(), torch.tensor(lens)  # alive through the call
    assert native.for_dtype("paged_decode", dtype)(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(),
        context_lens.data_ptr(), len(lens), max_blocks, block_size, num_heads,
        num_kv_heads, head_dim, scale, out.data_ptr(), 1) == 0
    group = num_heads // num_kv_heads
    # bfloat16: float32 inside, so the float32 result on the same inputs, rounded once
    tolerance = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2**-9, "rtol": 2**-7}
    for b, n in enumerate(lens):
        rows = torch.tensor([int(tables[b, t // block_size]) * block_size + t % block_size
                             for t in range(n)])
        keys = k_cache.float().view(-1, num_kv_heads, head_dim)[rows].repeat_interleave(group, 1)
        values = v_cache.float().view(-1, num_kv_heads, head_dim)[rows].repeat_interleave(group, 1)
        weights = (torch.einsum("hd,khd->hk", q[b].float(), keys) * scale).softmax(-1)
        expected = torch.einsum("hk,khd->hd", weights, values).to(dtype)
        torch.testing.assert_close(out[b], expected, **tolerance)


@needs_compiler
def test_bf16_decode_attention_runs_in_c_and_agrees_with_the_torch_path(monkeypatch):
    q, k, v, k_cache, v_cache, meta, _ = make_batch([5, 2, 9], [1, 1, 1], seed=4)
    q, k, v, k_cache, v_cache = (t.to(torch.bfloat16) for t in (q, k, v, k_cache, v_cache))
    with native.torch_paths_only():
        expected = paged_attention(q, k, v, k_cache.clone(), v_cache.clone(), meta, HEAD_DIM**-0.5)
    _, calls = spy_on_kernel(monkeypatch, "paged_decode_bf16")
    out = paged_attention(q, k, v, k_cache, v_cache, meta, HEAD_DIM**-0.5)
    assert len(calls) == 1
    torch.testing.assert_close(out, expected, atol=2**-8, rtol=2**-6)  # a rounding or two apart


@needs_compiler
def test_prefill_attention_falls_back_to_sdpa_where_head_dim_is_not_a_multiple_of_8():
    lens, num_heads, head_dim = [6, 3], 2, 12
    q, k, v = (torch.randn(sum(lens), num_heads, head_dim) for _ in range(3))
    meta = build_metadata([0, 0], lens, [[0], [1]], 16, torch.device("cpu"))
    with native.torch_paths_only():
        expected = attention_module._attend_new(q, k, v, meta, head_dim**-0.5)
    torch.testing.assert_close(attention_module._attend_new(q, k, v, meta, head_dim**-0.5),
                               expected, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("rows", [65, 77, 100, 129])
def test_a_bfloat16_prefill_product_meets_onednn_at_a_row_count_in_steps(rows, monkeypatch):
    """Past the decode rows, a bfloat16 product from the blocked copy runs on the rows
    rounded up to a step (oneDNN builds a product per row count it meets) and returns
    the rows asked for, each as the unpadded product gives it."""
    if not layers._blocks_bfloat16():
        pytest.skip("oneDNN takes no bfloat16 blocked weights on this CPU")
    module, weight, bias = _loaded_bf16_linear(96, 64, seed=rows)
    onednn = torch.ops.mkldnn._linear_pointwise
    met = []
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise",
                        lambda x, *args: met.append(x.shape[0]) or onednn(x, *args))
    x = torch.randn(rows, 64).bfloat16()
    out = module(x)
    step = layers.BLOCKED_ROW_STEP_BF16
    assert met == [-(-rows // step) * step] and out.shape == (rows, 96)
    exact = onednn(x, module.weight_blocked, module.bias, "none", [], "")
    torch.testing.assert_close(out, exact, atol=0, rtol=0)
    _assert_bf16_product(module, weight, bias, rows)


def test_warming_runs_each_bfloat16_weight_shape_at_every_padded_row_count_of_the_budget(monkeypatch):
    if not layers._blocks_bfloat16():
        pytest.skip("oneDNN takes no bfloat16 blocked weights on this CPU")
    modules = torch.nn.ModuleList([_loaded_bf16_linear(96, 64, seed=1)[0],
                                   _loaded_bf16_linear(96, 64, seed=2)[0],  # the same shape
                                   _loaded_bf16_linear(40, 24, seed=3)[0]])
    onednn = torch.ops.mkldnn._linear_pointwise
    met = []
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise",
                        lambda x, w, *args: met.append((tuple(w.shape), x.shape[0])) or onednn(x, w, *args))
    assert [layers.blocked_rows(n) for n in (64, 65, 80, 81, 100, 1000, 1025, 2049)] == \
        [64, 80, 80, 96, 112, 1008, 1056, 2112]
    assert layers.warm_blocked_products(modules, 100) == 6
    assert sorted(met) == [((40, 24), 80), ((40, 24), 96), ((40, 24), 112),
                           ((96, 64), 80), ((96, 64), 96), ((96, 64), 112)]
