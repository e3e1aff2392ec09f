"""The analytic latency model of the paper's Appendix A, for points no profile covers.

Per layer on one GPU of a tp-way instance (widths divided by tp):
- the GEMMs (QKV, O, FFN) cost 2 * tokens * params FLOPs and read the layer's weights
  once: a roofline max of compute time and weight-read time;
- prefill attention is FlashAttention: it re-reads K and V once per query block, about
  3 * s * l * (l / b) elements per head for a prompt of l tokens (memory bound);
- decode attention reads every context token's K and V once;
- tensor parallelism adds two ring all-reduces of the activations per layer over the
  intra-node link;
- a fixed per-layer cost stands for kernel launches of an engine without CUDA graphs.
A stage runs ceil(layers / pp) layers; consecutive stages hand activations over.

The efficiency factors below were tuned once against the authors' A100 profile (OPT-13B
tp 1/2/4 and OPT-66B tp 2/3/4/8; `benchmarks/latency_vs_profile.py` prints the errors)
and are the same for every model and accelerator.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from distserve.catalog import Accelerator, ModelArch
from distserve.latency.base import StageLatencyBase, layers_per_stage

# Large GEMMs reach ~70-75% of the tensor-core peak in a serving engine (cuBLAS, fp16).
GEMM_COMPUTE_EFFICIENCY = 0.72
# A GEMM with few rows fills few output tiles: efficiency rises as M / (M + M_half).
GEMM_HALF_EFFICIENCY_ROWS = 90
# Streaming the weights reaches ~90% of the HBM datasheet bandwidth.
MEMORY_EFFICIENCY = 0.90
# Paged decode attention (vLLM's kernel) gathers KV blocks: ~2/3 of streaming bandwidth.
DECODE_ATTENTION_MEMORY_EFFICIENCY = 0.65
# FlashAttention's query block (b in Appendix A): 128 rows on A100-class GPUs.
FLASH_ATTENTION_BLOCK = 128
# Attention kernels reach less of the peak than GEMMs (softmax, masking, small head dim).
ATTENTION_COMPUTE_EFFICIENCY = 0.48
# NCCL ring all-reduce of a few MB reaches about a third of the NVLink per-direction
# bandwidth (nccl-tests bus bandwidth is far below peak at these message sizes).
ALLREDUCE_LINK_EFFICIENCY = 0.36
# A ring all-reduce takes 2 * (tp - 1) steps, each paying a hop's launch and sync cost.
ALLREDUCE_HOP_LATENCY_S = 4.5e-6
# Compute and memory time overlap imperfectly near the ridge point: the GEMM time is the
# p-norm of the two (p = 1 adds them, a large p is the plain roofline max).
ROOFLINE_SHARPNESS = 2.8
# Kernel launches and Python dispatch per layer in an engine without CUDA graphs.
LAYER_OVERHEAD_S = 0.12e-3

# The colocated baseline is the vLLM 0.2-era engine the paper compared against. Its
# profile shows slower kernels (xformers attention, no fused GEMM epilogues) and a
# per-iteration cost that grows with tp (the Ray driver broadcasts every step's inputs
# to each worker). Tuned against the colocated rows of the same profile.
COLOCATED_COMPUTE_SLOWDOWN = 1.25
COLOCATED_ITERATION_OVERHEAD_S = 9.5e-3
COLOCATED_PER_WORKER_OVERHEAD_S = 0.8e-3


class AnalyticLatencyModel(StageLatencyBase):
    """Appendix A's latency model from a model's shape and an accelerator's peaks."""

    source = "analytic"

    def __init__(
        self,
        model: ModelArch,
        accelerator: Accelerator,
        tp: int,
        pp: int,
        serving_mode: str = "disaggregated",
        *,
        enable_dispatch_overhead: bool = True,
    ) -> None:
        super().__init__(
            model, accelerator, tp, pp, serving_mode, enable_dispatch_overhead=enable_dispatch_overhead
        )
        self.num_stage_layers = layers_per_stage(model, pp)
        is_colocated = serving_mode == "colocated"
        self.compute_slowdown = COLOCATED_COMPUTE_SLOWDOWN if is_colocated else 1.0
        self.engine_iteration_s = (
            (COLOCATED_ITERATION_OVERHEAD_S + COLOCATED_PER_WORKER_OVERHEAD_S * (tp - 1))
            if is_colocated
            else 0.0
        )

    # -- per-layer pieces -------------------------------------------------------------

    def _gemm_s(self, num_tokens: int) -> float:
        """QKV, O and FFN GEMMs of one layer on num_tokens rows: roofline max."""
        m, acc = self.model, self.accelerator
        params = m.layer_gemm_params / self.tp
        flops = 2.0 * num_tokens * params
        efficiency = GEMM_COMPUTE_EFFICIENCY * num_tokens / (num_tokens + GEMM_HALF_EFFICIENCY_ROWS)
        activation_elems = num_tokens * (4 * m.hidden_size + 3 * (m.q_size + m.ffn_size) / self.tp)
        weight_bytes = (params + activation_elems) * m.dtype_bytes
        compute_s = self.compute_slowdown * flops / (acc.peak_flops * efficiency)
        memory_s = weight_bytes / (acc.mem_bandwidth_bytes_per_s * MEMORY_EFFICIENCY)
        return _soft_max(compute_s, memory_s)

    def _prefill_attention_s(self, chunks: Sequence[tuple[int, int]]) -> float:
        """FlashAttention over each chunk's new tokens against its whole context."""
        m, acc = self.model, self.accelerator
        heads = math.ceil(m.num_heads / self.tp)
        pairs = sum(new * (new + done) for new, done in chunks)  # query-key pairs
        elems = 3 * heads * m.head_dim * pairs / FLASH_ATTENTION_BLOCK
        memory_s = elems * m.dtype_bytes / (acc.mem_bandwidth_bytes_per_s * MEMORY_EFFICIENCY)
        flops = 4.0 * heads * m.head_dim * pairs  # Q K^T and P V
        compute_s = self.compute_slowdown * flops / (acc.peak_flops * ATTENTION_COMPUTE_EFFICIENCY)
        return max(memory_s, compute_s)

    def _decode_attention_s(self, context_lens: Sequence[int]) -> float:
        """Each decoding sequence reads the K and V of its whole context."""
        m = self.model
        kv_heads = math.ceil(m.num_kv_heads / self.tp)
        kv_bytes = 2 * kv_heads * m.head_dim * m.dtype_bytes * sum(context_lens)
        bandwidth = self.accelerator.mem_bandwidth_bytes_per_s * DECODE_ATTENTION_MEMORY_EFFICIENCY
        return kv_bytes / bandwidth

    def _allreduce_s(self, num_tokens: int) -> float:
        """Two ring all-reduces of the layer's activations (after attention and FFN)."""
        if self.tp == 1:
            return 0.0
        message_bytes = num_tokens * self.model.hidden_size * self.model.dtype_bytes
        ring_bytes = 2 * (self.tp - 1) / self.tp * message_bytes
        link = self.accelerator.intra_node_link_bytes_per_s * ALLREDUCE_LINK_EFFICIENCY
        return 2 * (2 * (self.tp - 1) * ALLREDUCE_HOP_LATENCY_S + ring_bytes / link)

    def _lm_head_s(self, num_sequences: int) -> float:
        """Logits for each sequence's last token, spread over the stages (last stage only)."""
        m = self.model
        params = m.vocab_size * m.hidden_size / self.tp
        compute_s = (
            2.0 * num_sequences * params / (self.accelerator.peak_flops * GEMM_COMPUTE_EFFICIENCY)
        )
        memory_s = (
            params
            * m.dtype_bytes
            / (self.accelerator.mem_bandwidth_bytes_per_s * MEMORY_EFFICIENCY)
        )
        return max(compute_s, memory_s) / self.pp

    # -- one iteration ----------------------------------------------------------------

    def _iteration_s(
        self, chunks: Sequence[tuple[int, int]], decode_context_lens: Sequence[int]
    ) -> float:
        num_tokens = sum(new for new, _ in chunks) + len(decode_context_lens)
        if num_tokens == 0:
            return 0.0
        layer_s = (
            self._gemm_s(num_tokens)
            + self._prefill_attention_s(chunks)
            + self._decode_attention_s(decode_context_lens)
            + self._allreduce_s(num_tokens)
            + LAYER_OVERHEAD_S
        )
        num_sequences = len(chunks) + len(decode_context_lens)
        total_s = (
            self.num_stage_layers * layer_s
            + self._lm_head_s(num_sequences)
            + self.engine_iteration_s
        )
        return total_s + self._overhead_s(num_tokens)

    def prefill_stage_s(self, prompt_lens: Sequence[int]) -> float:
        """Seconds one stage spends on a prefill batch of these prompt lengths."""
        return self._iteration_s([(n, 0) for n in prompt_lens], [])

    def decode_stage_s(self, context_lens: Sequence[int]) -> float:
        """Seconds one stage spends on one decode step; lengths include the new token."""
        return self._iteration_s([], context_lens)

    def mixed_stage_s(
        self, prefill_chunks: Sequence[tuple[int, int]], decode_context_lens: Sequence[int]
    ) -> float:
        """One colocated iteration: prefill chunks (new, already in context) and decodes."""
        return self._iteration_s(prefill_chunks, decode_context_lens)


def _soft_max(a_s: float, b_s: float) -> float:
    """The roofline max of two times, softened by ROOFLINE_SHARPNESS."""
    p = ROOFLINE_SHARPNESS
    return (a_s**p + b_s**p) ** (1 / p)
