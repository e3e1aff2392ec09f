"""Building blocks shared by the models: tensor-parallel linears, norms, rotary.

Each linear knows how to load its slice of a full HF weight for this tp rank, so a
model's `load_weights` only maps names. Column-parallel layers split output features
(heads, MLP columns); row-parallel layers split input features and all-reduce.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from distserve_engine import native
from distserve_engine.errors import UnsupportedArchitectureError
from distserve_engine.parallel import ParallelState, tp_all_reduce


def _shard(x: torch.Tensor, dim: int, rank: int, size: int) -> torch.Tensor:
    """Rank's equal slice of x along dim."""
    step = x.shape[dim] // size
    return x.narrow(dim, rank * step, step)


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with output features split across tp ranks; parts may be fused."""

    def __init__(self, in_features: int, part_sizes: list[int], bias: bool,
                 state: ParallelState) -> None:
        super().__init__()
        self.state = state
        self.in_features = in_features
        self.local_sizes = [n // state.tp for n in part_sizes]  # per-part output on this rank
        out_local = sum(self.local_sizes)
        self.weight = nn.Parameter(torch.empty(out_local, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_local), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(T, in) -> (T, out_local)."""
        return _linear(x, self, self.bias)

    def load(self, tensor: torch.Tensor, part: int = 0, is_bias: bool = False) -> None:
        """Copy this rank's slice of one full part (e.g. q of a fused qkv)."""
        start = sum(self.local_sizes[:part])
        local = _shard(tensor, 0, self.state.tp_rank, self.state.tp)
        target = self.bias if is_bias else self.weight
        target.data[start:start + self.local_sizes[part]].copy_(local)


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_local W_local^T) + b with input features split across tp ranks."""

    def __init__(self, in_features: int, out_features: int, bias: bool,
                 state: ParallelState) -> None:
        super().__init__()
        self.state = state
        self.in_features = in_features // state.tp  # local
        self.weight = nn.Parameter(torch.empty(out_features, in_features // state.tp),
                                   requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(T, in_local) -> (T, out), summed over tp ranks."""
        y = tp_all_reduce(_linear(x, self, None), self.state)
        return y if self.bias is None else y + self.bias

    def load(self, tensor: torch.Tensor, is_bias: bool = False) -> None:
        """Copy this rank's input-feature slice (the bias is whole on every rank)."""
        if is_bias:
            self.bias.data.copy_(tensor)
        else:
            self.weight.data.copy_(_shard(tensor, 1, self.state.tp_rank, self.state.tp))


@dataclass(frozen=True)
class Packing:
    """A dtype's packed weights (`native.for_dtype("pack_linear" | "packed_linear", ...)`):
    the packed size, and the most rows the product takes (more go to the oneDNN-blocked
    copy)."""

    size: Callable[[int, int], int]
    max_rows: int


PACKINGS = {
    torch.float32: Packing(native.packed_linear_size, native.PACKED_MAX_ROWS),
    torch.bfloat16: Packing(native.packed_linear_bf16_size, native.PACKED_MAX_ROWS_BF16),
}


def transpose_for_cpu(module: nn.Module, keep_weight: bool = False) -> None:
    """Store a loaded linear's weight in the layouts CPU GEMMs favour. In float32 with the
    C kernels and oneDNN: packed in panels (`native.packed_linear`) for products of up to
    `native.PACKED_MAX_ROWS` rows (a decode step's), and a oneDNN-blocked copy for more (a
    prefill's). In bfloat16 on a CPU with AMX, the same: packed in AMX's pair layout
    (`native.packed_linear_bf16`) for up to `native.PACKED_MAX_ROWS_BF16` rows, the blocked
    copy for more; elsewhere where oneDNN takes bfloat16, the blocked copy alone, for every
    product (`_blocks_bfloat16`). Otherwise as (in, out) for products of 1-2 rows and, with
    oneDNN, the blocked copy for 3 rows or more.

    NOTE: with weight (out, in) MKL re-packs the matrix on every call; on this CPU a
    (8..32, 576) x (576, 3072) fp32 product ran 1.3-1.8x faster from the transposed copy.
    A decode step streams every layer's weights from memory once; over SmolLM2's 30
    layers so read (not one weight timed hot in cache), the blocked copies ran 1.1x faster
    than (in, out) at 3 rows, 1.6x at 4 and 8, 1.35x at 32 and level from 256 up, but
    1.15x slower at 2 rows and 1.4x at 1; the packed panels ran level with (in, out) at
    one row and 1.3-1.6x faster than the blocked copies from 2 to 64 rows. In bfloat16 over
    the same 30 layers, one thread, AMX, the packed copies ran 1.1-1.2x faster than
    oneDNN's blocked ones from 1 to 32 rows (7 alternating rounds), level at 48, and 0.7x
    at 128. So two copies are kept: twice the linears' memory. The (out, in) weight is
    dropped unless kept (a head tied to the input embedding, whose rows the embedding
    reads). Call after loading weights.
    """
    weight = module.weight.detach()
    packing = PACKINGS.get(weight.dtype)
    pack = native.for_dtype("pack_linear", weight.dtype)
    if pack is not None and torch.backends.mkldnn.is_available():
        out_features, in_features = weight.shape
        module.weight_packed = torch.empty(packing.size(out_features, in_features), dtype=weight.dtype)
        pack(weight.contiguous().data_ptr(), out_features, in_features,
             module.weight_packed.data_ptr())
        module.packed_out_features = out_features
        min_blocked_rows = packing.max_rows + 1
    elif weight.dtype == torch.bfloat16 and _blocks_bfloat16():
        min_blocked_rows = 1  # the blocked copy serves every product; no (in, out) copy
    else:
        module.weight_t = weight.t().contiguous()  # (in, out)
        min_blocked_rows = 3
    if getattr(module, "weight_blocked", None) is None:  # the head has its own already
        _add_blocked(module, weight, min_rows=min_blocked_rows)
    else:
        module.blocked_min_rows = min(module.blocked_min_rows, min_blocked_rows)
    if not keep_weight:
        del module.weight


def block_head_for_cpu(module: nn.Module) -> None:
    """Keep a oneDNN-blocked copy of the LM head's (out, in) weight for products of 2 rows
    or more; one row reads the (in, out) copy that `transpose_for_cpu` makes (where the
    packed copy is made, it serves up to `native.PACKED_MAX_ROWS` rows instead).

    NOTE: the head (vocab x hidden, 113 MB for SmolLM2) is the largest GEMM of a decode
    step; from the plain layouts MKL re-packs it on every call. From the blocked copy the
    product over 8-64 rows ran 1.4-1.8x faster on this CPU, and 1.9x at 2 rows. Costs one
    more copy of the head. (At one row the (in, out) copy took 8.7 ms where a GEMV over the
    (out, in) weight took 14.6.)
    """
    _add_blocked(module, module.weight.detach(), min_rows=2)  # before transpose_for_cpu


def _add_blocked(module: nn.Module, weight: torch.Tensor, min_rows: int) -> None:
    blocks = weight.dtype == torch.float32 and torch.backends.mkldnn.is_available()
    if blocks or (weight.dtype == torch.bfloat16 and _blocks_bfloat16()):
        module.weight_blocked = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous())
        module.blocked_min_rows = min_rows


def _blocks_bfloat16() -> bool:
    """Whether oneDNN multiplies bfloat16 from a blocked weight on this CPU.

    NOTE: over SmolLM2's 30 layers of linears, one thread, a CPU with AMX, the blocked
    bfloat16 copies took 21-23 ms a pass at 1-16 rows and 25-27 at 32, where torch.mm
    from (in, out) copies took 30-50 (it re-packs each weight on every call); the LM head
    2.6-3.1 ms from its blocked copy at 1-8 rows, 7-8 from (in, out). From 2048 rows the
    two ran level. So where no packed copy is made (no AMX), bfloat16 keeps the blocked
    copy only, for every row count.
    """
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def stored_weight(module: nn.Module) -> torch.Tensor:
    """The copy of a linear's weight that a one-row product reads: the plain weight, else
    the packed, (in, out) or blocked copy that replaced it."""
    weight = getattr(module, "weight", None)
    if weight is not None:
        return weight
    for copy in ("weight_packed", "weight_t"):
        if getattr(module, copy, None) is not None:
            return getattr(module, copy)
    return module.weight_blocked


def linear(x: torch.Tensor, module: nn.Module) -> torch.Tensor:
    """x times a linear's weight, without bias or tp reduction, as the engine runs it."""
    return _linear(x, module, None)


def _linear(x: torch.Tensor, module: nn.Module, bias: torch.Tensor | None) -> torch.Tensor:
    packed = getattr(module, "weight_packed", None)
    if packed is not None:
        is_few = x.shape[0] <= PACKINGS[packed.dtype].max_rows
        kernel = native.for_dtype("packed_linear", packed.dtype) if is_few else None
        out = _packed_linear(kernel, x, module, packed, bias) if kernel is not None else None
        if out is not None:
            return out
        # more rows (a prefill), the kernels off (native.torch_paths_only), or a product
        # the kernel refused (no scratch memory): the blocked copy
        return _blocked_linear(x, module.weight_blocked, bias)
    blocked = getattr(module, "weight_blocked", None)
    if blocked is not None and x.shape[0] >= module.blocked_min_rows:
        return _blocked_linear(x, blocked, bias)
    weight_t = getattr(module, "weight_t", None)
    if weight_t is None:
        return F.linear(x, module.weight, bias)
    return torch.mm(x, weight_t) if bias is None else torch.addmm(bias, x, weight_t)


# bfloat16 products from the blocked copy over more rows than this run on a padded row
# count (`blocked_rows`).
BLOCKED_ROWS_EXACT_BF16 = 64
BLOCKED_ROW_STEP_BF16 = 16  # the padding's step up to 1023 rows; it doubles as rows do


def blocked_rows(rows: int) -> int:
    """The row count a bfloat16 product of `rows` rows runs on: `rows` up to
    BLOCKED_ROWS_EXACT_BF16; else rounded up to a step of BLOCKED_ROW_STEP_BF16 below 1024
    rows (at most 15 rows more), and from there to a step of 1/64 of the power of two above
    them (at most 1/32 more rows)."""
    if rows <= BLOCKED_ROWS_EXACT_BF16:
        return rows
    step = max(BLOCKED_ROW_STEP_BF16, (1 << rows.bit_length()) // 64)
    return -(-rows // step) * step


def _blocked_linear(x: torch.Tensor, blocked: torch.Tensor,
                    bias: torch.Tensor | None) -> torch.Tensor:
    """x times a oneDNN-blocked weight (+ bias). In bfloat16, x padded with zero rows to
    `blocked_rows`, the product's first rows returned.

    NOTE: oneDNN builds (JITs) a bfloat16 product for each row count it meets and caches
    1024 of them: on this CPU (AMX, one thread) ~4.5 ms for a (300, 576) x (576, 1536)
    product whose run takes ~1.2 ms, where float32's build costs nothing measurable. A
    stream of prompts of random lengths from 64 to 512 tokens prefilled at 0.92x the rate
    of the same prompts met again; padded, at 0.99x (the padding itself cost ~0.5%).
    `warm_blocked_products` builds a prefill budget's row counts ahead.
    """
    rows = x.shape[0]
    padded_rows = blocked_rows(rows) if x.dtype == torch.bfloat16 else rows
    if padded_rows == rows:
        return torch.ops.mkldnn._linear_pointwise(x, blocked, bias, "none", [], "")
    padded = x.new_empty(padded_rows, x.shape[1])
    padded[:rows] = x
    padded[rows:] = 0
    return torch.ops.mkldnn._linear_pointwise(padded, blocked, bias, "none", [], "")[:rows]


def warm_blocked_products(layers: nn.Module, max_rows: int) -> int:
    """Run each bfloat16 blocked weight shape in `layers` (a model's decoder layers) once
    at every padded row count (`blocked_rows`) that a prefill of up to `max_rows` tokens
    meets, so that oneDNN has built those products before the first request. Returns how
    many products ran."""
    weights = {}  # one blocked weight of each shape
    for module in layers.modules():
        blocked = getattr(module, "weight_blocked", None)
        if blocked is not None and blocked.dtype == torch.bfloat16:
            weights.setdefault(tuple(blocked.shape), blocked)
    counts = sorted({blocked_rows(rows) for rows in range(BLOCKED_ROWS_EXACT_BF16 + 1, max_rows + 1)})
    for (_, in_features), blocked in weights.items():
        for rows in counts:  # every one past a packed copy's rows and any blocked_min_rows
            _blocked_linear(torch.zeros(rows, in_features, dtype=torch.bfloat16), blocked, None)
    return len(weights) * len(counts)


def _packed_linear(kernel, x: torch.Tensor, module: nn.Module, packed: torch.Tensor,
                   bias: torch.Tensor | None) -> torch.Tensor | None:
    """x times the packed weight (+ bias) by the C kernel; None where it refused."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    rows, in_features = x.shape
    out_features = module.packed_out_features
    out = torch.empty(rows, out_features, dtype=packed.dtype)
    bias = None if bias is None else bias.contiguous()
    status = kernel(x.data_ptr(), x.stride(0), rows, packed.data_ptr(), out_features,
                    in_features, None if bias is None else bias.data_ptr(), out.data_ptr(),
                    out_features, torch.get_num_threads())
    return out if status == 0 else None


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(T, size) -> (T, size)."""
        kernel = None
        if (x.device.type == "cpu" and x.dim() == 2 and x.stride(-1) == 1
                and self.weight.dtype == x.dtype):
            kernel = native.for_dtype("rms_norm", x.dtype)
        if kernel is not None:
            out = torch.empty(x.shape, dtype=x.dtype)
            kernel(x.data_ptr(), x.stride(0), self.weight.data_ptr(), out.data_ptr(),
                   x.shape[0], x.shape[1], self.eps)
            return out
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        y = F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps)
        return y.to(x.dtype)


RopeTable = tuple[torch.Tensor, torch.Tensor]  # cos, signed sin: (T, 1, D) each


class RotaryEmbedding(nn.Module):
    """HF-style (half-split) rotary position embedding with a precomputed cos/sin table."""

    def __init__(self, head_dim: int, max_position: int, theta: float,
                 scaling: dict | None) -> None:
        super().__init__()
        inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        inv_freq = _scale_inv_freq(inv_freq, scaling)
        t = torch.arange(max_position, dtype=torch.float64)
        freqs = torch.outer(t, inv_freq)  # (P, D/2)
        self.register_buffer("cos", freqs.cos().float(), persistent=False)
        self.register_buffer("sin", freqs.sin().float(), persistent=False)

    def table(self, positions: torch.Tensor, dtype: torch.dtype) -> RopeTable:
        """cos and signed sin at these positions, (T, 1, D) each, built once per step.

        cos repeats its half; sin is negated in its first half, so that rotating x is
        x * cos + cat(x2, x1) * sin with x = cat(x1, x2).
        """
        cos = self.cos[positions]  # (T, D/2)
        sin = self.sin[positions]  # (T, D/2)
        full_cos = torch.cat((cos, cos), dim=-1)[:, None, :].to(dtype)  # (T, 1, D)
        signed_sin = torch.cat((-sin, sin), dim=-1)[:, None, :].to(dtype)  # (T, 1, D)
        return full_cos, signed_sin

    @staticmethod
    def rotate_(x: torch.Tensor, table: RopeTable) -> None:
        """Rotate x (T, n, D), any heads of q and k at once, in place (in x's dtype, as HF)."""
        cos, signed_sin = table
        rows, heads, head_dim = x.shape
        if (cos.dtype == x.dtype and x.device.type == "cpu" and x.stride(-1) == 1
                and x.stride(-2) == head_dim and cos.is_contiguous() and signed_sin.is_contiguous()):
            kernel = native.for_dtype("rotary", x.dtype)
            if kernel is not None:
                kernel(x.data_ptr(), x.stride(0), rows, heads, head_dim, cos.data_ptr(),
                       signed_sin.data_ptr(), torch.get_num_threads())
                return
        half = head_dim // 2
        swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)  # (T, n, D)
        x.mul_(cos).addcmul_(swapped, signed_sin)


def _scale_inv_freq(inv_freq: torch.Tensor, scaling: dict | None) -> torch.Tensor:
    """Apply `rope_scaling` (none, linear or llama3) to the inverse frequencies."""
    kind = (scaling or {}).get("rope_type") or (scaling or {}).get("type") or "default"
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    raise UnsupportedArchitectureError(f"rope_scaling: type {kind!r} is not supported")


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    is_medium = (wavelen <= old_len / low) & (wavelen >= old_len / high)
    return torch.where(is_medium, blended, out)
