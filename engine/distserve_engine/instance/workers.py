"""One instance on tp x pp ranks: rank 0 drives, every other rank replays its calls.

The engine is SPMD: every rank builds `ModelRunner(config, rank)` and must receive the
same calls in the same order. Rank 0 hosts the instance loop and the HTTP server as at
tp = pp = 1, through `DriverRunner`, a runner-like facade: each prefill, decode, free,
export or import first goes to the worker ranks as one small control message (the
sequences as plain data, with their block tables, on a gloo group of its own), then
runs on rank 0; the model's collectives run on the runner's own groups. Tokens come
from rank 0 (the runner already broadcasts the last stage's). A KV blob leaves and
enters the instance whole (every layer, every KV head): export gathers each rank's
layers and heads to rank 0, import scatters them back.
# NOTE: block tables stay equal on every rank because every block manager sees the same
# reserve / free calls from the same free list (sized to the smallest rank's cache);
# each call carries rank 0's free-block count so a divergence fails loudly.
"""

from __future__ import annotations

import ctypes
import logging
import math
import multiprocessing as mp
import os
import signal
import threading
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from distserve_engine.block_manager import BlockManager
from distserve_engine.config import EngineConfig
from distserve_engine.errors import EngineError
from distserve_engine.instance.ranks import RankLayout
from distserve_engine.kv_cache import KVBlob, kv_views
from distserve_engine.parallel import ParallelState
from distserve_engine.runner import ModelRunner
from distserve_engine.sequence import Sequence

log = logging.getLogger(__name__)

# NOTE: workers wait in a broadcast while the instance is idle; gloo's default 30 min
# timeout would end them, so the control group waits (practically) forever.
CONTROL_TIMEOUT = timedelta(days=365)
PR_SET_PDEATHSIG = 1  # prctl option: a signal when the parent process dies


@dataclass
class Call:
    """One runner call, sent from rank 0 to every worker before rank 0 runs it.

    Each kind of call is a subclass that replays itself on a worker rank (`replay`):
    the worker loop dispatches on the type, never on a name.
    """

    num_free_blocks: int = field(default=0, kw_only=True)  # rank 0's, before the call

    def replay(self, runner: ModelRunner, group: Any) -> None:
        """Run this call on a worker rank (its part of the collective, if any)."""
        raise NotImplementedError


@dataclass
class Prefill(Call):
    seqs: list[Sequence]  # as they are before the call

    def replay(self, runner: ModelRunner, group: Any) -> None:
        runner.prefill(self.seqs)


@dataclass
class Decode(Call):
    seqs: list[Sequence]

    def replay(self, runner: ModelRunner, group: Any) -> None:
        runner.decode(self.seqs)


@dataclass
class Free(Call):
    seq: Sequence

    def replay(self, runner: ModelRunner, group: Any) -> None:
        runner.free(self.seq)


@dataclass
class ExportKV(Call):
    """Every worker sends its layers and heads of the sequence's KV to rank 0."""

    seq: Sequence

    def replay(self, runner: ModelRunner, group: Any) -> None:
        blob = runner.export_kv(self.seq)
        for tensor in (blob.k, blob.v):
            dist.send(tensor.cpu().contiguous(), dst=0, group=group)


@dataclass
class ImportKV(Call):
    """Every worker receives its layers and heads of a pulled blob from rank 0."""

    seq: Sequence
    num_tokens: int  # tokens in the blob

    def replay(self, runner: ModelRunner, group: Any) -> None:
        s = runner.kv_cache.shape
        parts = [torch.empty((s.num_layers, self.num_tokens, s.num_kv_heads, s.head_dim),
                             dtype=s.dtype) for _ in range(2)]  # K, V: (L_rank, n, Hkv_rank, D)
        for part in parts:
            dist.recv(part, src=0, group=group)
        runner.import_kv(self.seq, KVBlob(k=parts[0], v=parts[1], num_tokens=self.num_tokens))


@dataclass
class Stop(Call):
    """The instance stops: the worker loop ends."""


def join(config: EngineConfig, rank: int) -> tuple[ModelRunner, Any]:
    """Build this rank's runner and the instance's control group; equalize KV blocks."""
    runner = ModelRunner(config, rank)
    group = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    num_blocks = torch.tensor([runner.num_blocks])
    dist.all_reduce(num_blocks, op=dist.ReduceOp.MIN, group=group)
    if int(num_blocks) < runner.num_blocks:  # a stage with fewer layers fits more blocks
        runner.num_blocks = int(num_blocks)
        runner.block_manager = BlockManager(runner.num_blocks, config.block_size)
    return runner, group


class DriverRunner:
    """Rank 0's runner as the instance sees it; every call also runs on the workers."""

    def __init__(self, runner: ModelRunner, group: Any, workers: list[Any] | None = None) -> None:
        self.runner = runner
        self.group = group
        self.workers = workers or []  # local worker processes, joined on stop
        self._lock = threading.Lock()  # one call at a time: the engine and transfer threads
        cfg, m = runner.config, runner.model_config
        self._rank_states = [ParallelState(cfg.tp, cfg.pp, r) for r in range(cfg.world_size)]
        self._kv_heads = m.num_kv_heads // cfg.tp  # per rank
        self._num_layers = m.num_layers

    @property
    def config(self) -> EngineConfig:
        """The engine settings (tp and pp of the whole instance)."""
        return self.runner.config

    @property
    def tokenizer(self) -> Any:
        """The checkpoint's tokenizer."""
        return self.runner.tokenizer

    @property
    def max_model_len(self) -> int:
        """Longest sequence the cache accepts."""
        return self.runner.max_model_len

    @property
    def block_manager(self) -> BlockManager:
        """Rank 0's block manager; every rank's sees the same calls, so they are equal."""
        return self.runner.block_manager

    @property
    def kv_capacity_bytes(self) -> int:
        """Bytes of KV the whole instance's cache holds, over all ranks."""
        return self.block_manager.num_blocks * self.config.block_size * self.kv_bytes_per_token

    def check_stop(self, seq: Sequence) -> str:
        """Stop checks run on rank 0 only: they read tokens, not the model."""
        return self.runner.check_stop(seq)

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V one token takes over all ranks (what a transfer moves)."""
        shape = self.runner.kv_cache.shape
        return 2 * self._num_layers * self._kv_heads * self.runner.config.tp * shape.head_dim \
            * shape.dtype.itemsize

    def prefill(self, seqs: list[Sequence]) -> list[int]:
        """Prefill on every rank; the sampled tokens."""
        with self._lock:
            self._send(Prefill(seqs))
            return self.runner.prefill(seqs)

    def decode(self, seqs: list[Sequence]) -> list[int]:
        """One decode step on every rank; the sampled tokens."""
        with self._lock:
            self._send(Decode(seqs))
            return self.runner.decode(seqs)

    def free(self, seq: Sequence) -> None:
        """Free the sequence's blocks on every rank."""
        with self._lock:
            self._send(Free(seq))
            self.runner.free(seq)

    def export_kv(self, seq: Sequence, into: torch.Tensor | None = None) -> KVBlob:
        """The sequence's KV over all layers and heads, gathered to rank 0 (into the uint8
        buffer `into`, K then V, when given)."""
        with self._lock:
            self._send(ExportKV(seq))
            own = self.runner.export_kv(seq)
            n = own.num_tokens
            shape = self._full_shape(n)
            if into is None:
                full = [own.k.new_empty(shape) for _ in range(2)]  # K, V
            else:
                nbytes = 2 * own.k.dtype.itemsize * math.prod(shape)
                full = list(kv_views(into[:nbytes], shape, own.k.dtype))
            for state in self._rank_states:
                for part, tensor in zip(full, (own.k, own.v), strict=True):
                    if state.rank != 0:
                        tensor = torch.empty(self._rank_shape(state, n), dtype=own.k.dtype)
                        dist.recv(tensor, src=state.rank, group=self.group)
                    part[self._index(state)] = tensor.to(part.device)
            return KVBlob(k=full[0], v=full[1], num_tokens=n)

    def import_kv(self, seq: Sequence, blob: KVBlob) -> None:
        """Scatter the blob's layers and heads to their ranks and import them everywhere."""
        expected = self._full_shape(blob.num_tokens)
        if tuple(blob.k.shape) != expected or tuple(blob.v.shape) != expected:
            raise EngineError(f"import_kv: blob shape {tuple(blob.k.shape)} does not match "
                              f"this instance's {expected}")
        with self._lock:
            self._send(ImportKV(seq, blob.num_tokens))
            for state in self._rank_states[1:]:
                for tensor in (blob.k, blob.v):
                    dist.send(tensor[self._index(state)].cpu().contiguous(), dst=state.rank,
                              group=self.group)
            own = self._rank_states[0]
            self.runner.import_kv(seq, KVBlob(k=blob.k[self._index(own)], v=blob.v[self._index(own)],
                                              num_tokens=blob.num_tokens))

    def stop(self) -> None:
        """End the worker ranks' loops."""
        with self._lock:
            self._send(Stop())
        for proc in self.workers:
            proc.join(timeout=10)

    def _send(self, call: Call) -> None:
        call.num_free_blocks = self.runner.block_manager.num_free_blocks
        dist.broadcast_object_list([call], src=0, group=self.group)

    def _full_shape(self, num_tokens: int) -> tuple[int, ...]:
        head_dim = self.runner.kv_cache.shape.head_dim
        return (self._num_layers, num_tokens, self._kv_heads * self.runner.config.tp, head_dim)

    def _rank_shape(self, state: ParallelState, num_tokens: int) -> tuple[int, ...]:
        layers = state.layer_range(self._num_layers)
        return (len(layers), num_tokens, self._kv_heads, self.runner.kv_cache.shape.head_dim)

    def _index(self, state: ParallelState) -> tuple[slice, slice, slice]:
        """Where a rank's part sits in a whole blob (L, n, Hkv, D): its layers and heads."""
        layers = state.layer_range(self._num_layers)
        heads = slice(state.tp_rank * self._kv_heads, (state.tp_rank + 1) * self._kv_heads)
        return slice(layers.start, layers.stop), slice(None), heads


def serve_worker(runner: ModelRunner, group: Any) -> None:
    """Replay rank 0's calls until it says stop (a worker rank's whole life)."""
    while True:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=group)
        call: Call = box[0]
        if isinstance(call, Stop):
            return
        if runner.block_manager.num_free_blocks != call.num_free_blocks:
            raise EngineError(f"rank {runner.parallel.rank}: {runner.block_manager.num_free_blocks} "
                              f"free KV blocks, rank 0 has {call.num_free_blocks}")
        try:
            call.replay(runner, group)
        except EngineError:  # bad input: rank 0 raised the same error before any collective
            log.warning("rank %d: %s failed", runner.parallel.rank, type(call).__name__, exc_info=True)


def start_ranks(layout: RankLayout, config: EngineConfig, cores: list[int] | None = None
                ) -> DriverRunner | ModelRunner | None:
    """Start this process's child ranks, then join as `layout.first_rank`.

    Returns rank 0's DriverRunner, or a worker's ModelRunner (serve it with
    `run_worker`), or None when the instance has a single rank.
    """
    if layout.world_size == 1:
        return None
    config = replace(config, tp=layout.tp, pp=layout.pp, dist_init_method=layout.init_method)
    rank_cores = layout.split_cores(cores)
    ctx = mp.get_context("spawn")
    children = []
    for rank, rank_cores_i in zip(layout.local_ranks[1:], rank_cores[1:], strict=True):
        child = ctx.Process(target=_worker_main, args=(config, rank, rank_cores_i),
                            name=f"rank-{rank}", daemon=True)
        child.start()
        children.append(child)
    runner, group = join(config, layout.first_rank)
    if layout.is_driver:
        return DriverRunner(runner, group, children)
    runner.control_group = group
    runner.children = children
    return runner


def run_worker(runner: ModelRunner) -> None:
    """Serve a worker rank started by `start_ranks` until rank 0 stops."""
    serve_worker(runner, runner.control_group)
    for child in runner.children:
        child.join(timeout=10)
    dist.destroy_process_group()


def _worker_main(config: EngineConfig, rank: int, cores: list[int] | None) -> None:
    """A child rank's process: pinned, dies with its parent, replays rank 0's calls."""
    libc = ctypes.CDLL(None)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if cores:
        os.sched_setaffinity(0, set(cores))
        torch.set_num_threads(len(cores))
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s rank{rank} %(name)s %(message)s")
    runner, group = join(config, rank)
    serve_worker(runner, group)
    dist.destroy_process_group()
