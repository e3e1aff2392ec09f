"""Every attention path gives what plain per-sequence attention gives over the same tokens."""

from __future__ import annotations

import pytest
import torch

from distserve_engine import flash_paged, native
from distserve_engine.attention import build_metadata, paged_attention
from distserve_engine.models.layers import RotaryEmbedding

BLOCK_SIZE = 4
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 4, 2, 8


def reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int) -> torch.Tensor:
    """Attention of q (n, H, D) at positions start.. over keys/values (start + n, Hkv, D)."""
    group = NUM_HEADS // NUM_KV_HEADS
    keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q, keys) * HEAD_DIM**-0.5  # (H, n, K)
    positions = torch.arange(start, start + q.shape[0])
    scores = scores.masked_fill(torch.arange(keys.shape[0])[None, :] > positions[:, None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), values).reshape(q.shape[0], -1)


def make_batch(starts: list[int], num_new: list[int], seed: int = 0):
    """Caches holding each sequence's first starts[i] tokens in scattered blocks, the new
    tokens' q/k/v, the metadata, and every sequence's full K/V for the reference."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = 64
    k_cache = torch.zeros(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    v_cache = torch.zeros_like(k_cache)
    free = torch.randperm(num_blocks, generator=g).tolist()  # scattered, not in order
    tables, full = [], []
    for start, n in zip(starts, num_new, strict=True):
        table = [free.pop() for _ in range(-(-(start + n) // BLOCK_SIZE))]
        kv = torch.randn(2, start + n, NUM_KV_HEADS, HEAD_DIM, generator=g)
        for pos in range(start):
            block, offset = table[pos // BLOCK_SIZE], pos % BLOCK_SIZE
            k_cache[block, offset], v_cache[block, offset] = kv[0, pos], kv[1, pos]
        tables.append(table)
        full.append(kv)
    q = torch.randn(sum(num_new), NUM_HEADS, HEAD_DIM, generator=g)
    k = torch.cat([kv[0, s:] for kv, s in zip(full, starts, strict=True)])
    v = torch.cat([kv[1, s:] for kv, s in zip(full, starts, strict=True)])
    meta = build_metadata(starts, num_new, tables, BLOCK_SIZE, torch.device("cpu"))
    return q, k, v, k_cache, v_cache, meta, full


@pytest.fixture(params=["C kernel", "torch"])
def cpu_decode(request, monkeypatch):
    """Run the test once with the CPU decode step on the C kernel, once on torch's path."""
    if request.param == "torch":
        monkeypatch.setattr(native, "paged_decode", lambda: None)
    elif native.paged_decode() is None:
        pytest.skip("no C compiler here: the CPU decode kernel cannot be built")
    return request.param


@pytest.mark.usefixtures("cpu_decode")
@pytest.mark.parametrize(("starts", "num_new"), [
    ([5, 0, 17, 2], [1, 1, 1, 1]),  # decode, contexts of different lengths
    ([0, 0, 0], [6, 6, 6]),  # prefill, equal prompts (views, no padding)
    ([0, 0, 0], [3, 9, 1]),  # prefill, unequal prompts (padded, causal without a mask)
    ([7, 0, 12], [3, 5, 1]),  # a cached prefix (gather and mask)
])
def test_paged_attention_matches_per_sequence_attention(starts, num_new):
    q, k, v, k_cache, v_cache, meta, full = make_batch(starts, num_new)
    out = paged_attention(q, k, v, k_cache, v_cache, meta, HEAD_DIM**-0.5)
    first = 0
    for start, n, kv in zip(starts, num_new, full, strict=True):
        expected = reference(q[first:first + n], kv[0], kv[1], start)
        torch.testing.assert_close(out[first:first + n], expected, atol=1e-5, rtol=1e-5)
        first += n


@pytest.mark.parametrize("threads", [1, 2])
def test_the_c_kernel_decodes_long_scattered_contexts_as_per_sequence_attention(threads):
    if native.paged_decode() is None:
        pytest.skip("no C compiler here: the CPU decode kernel cannot be built")
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        starts = [63, 0, 40, 7, 1, 22]  # 64 tokens: 16 blocks, each elsewhere in the cache
        q, k, v, k_cache, v_cache, meta, full = make_batch(starts, [1] * len(starts), seed=3)
        out = paged_attention(q, k, v, k_cache, v_cache, meta, HEAD_DIM**-0.5)
    finally:
        torch.set_num_threads(previous)
    assert not meta.buffers  # nothing gathered
    for i, (start, kv) in enumerate(zip(starts, full, strict=True)):
        torch.testing.assert_close(out[i:i + 1], reference(q[i:i + 1], kv[0], kv[1], start),
                                   atol=1e-5, rtol=1e-5)


def test_decode_reuses_the_steps_context_buffers_across_layers(monkeypatch):
    monkeypatch.setattr(native, "paged_decode", lambda: None)  # the torch path
    q, k, v, k_cache, v_cache, meta, full = make_batch([9, 3], [1, 1], seed=1)
    first = paged_attention(q, k, v, k_cache, v_cache, meta, HEAD_DIM**-0.5)
    buffers = dict(meta.buffers)
    second = paged_attention(q, k, v, k_cache.clone(), v_cache.clone(), meta, HEAD_DIM**-0.5)
    assert all(meta.buffers[name] is buffer for name, buffer in buffers.items())
    torch.testing.assert_close(first, second)


def test_rotary_in_place_matches_hf_rotate_half():
    rotary = RotaryEmbedding(HEAD_DIM, 64, 10000.0, None)
    positions = torch.tensor([0, 5, 63])
    x = torch.randn(3, 5, HEAD_DIM)
    cos, sin = rotary.cos[positions][:, None], rotary.sin[positions][:, None]  # (T, 1, D/2)
    x1, x2 = x.chunk(2, dim=-1)
    expected = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    rotated = x.clone()
    RotaryEmbedding.rotate_(rotated, rotary.table(positions, x.dtype))
    torch.testing.assert_close(rotated, expected)


def test_flash_kernel_inputs_and_where_it_applies():
    meta = build_metadata([5, 30], [1, 1], [[3], [7, 1]], 16, torch.device("cpu"))
    tables, lens = flash_paged.kernel_inputs(meta.block_tables, meta.context_lens)
    assert tables.dtype == lens.dtype == torch.int32
    assert tables.tolist() == [[3, 0], [7, 1]] and lens.tolist() == [6, 31]
    assert not flash_paged.is_supported("cpu", torch.bfloat16, 256)
    assert not flash_paged.is_supported("cuda", torch.float32, 256)
    assert not flash_paged.is_supported("cuda", torch.bfloat16, 16)
