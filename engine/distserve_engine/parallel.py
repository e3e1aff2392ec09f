"""Tensor and pipeline parallelism over torch.distributed.

Ranks are laid out pipeline-major: rank = pp_rank * tp + tp_rank. Each pipeline stage
owns a contiguous range of layers; within a stage, attention heads and MLP columns are
split across tp ranks (Megatron style: column-parallel in, row-parallel out, one
all-reduce per block). Every rank is driven with the same calls (SPMD); the last stage
samples and broadcasts the tokens so every rank's sequences stay identical.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from distserve_engine.errors import EngineError


@dataclass
class ParallelState:
    """This rank's place in the tp x pp grid, and its process groups."""

    tp: int = 1
    pp: int = 1
    rank: int = 0
    tp_group: object | None = None  # torch.distributed group of this stage's tp ranks

    @property
    def tp_rank(self) -> int:
        """Index within the tensor-parallel group."""
        return self.rank % self.tp

    @property
    def pp_rank(self) -> int:
        """Index of this rank's pipeline stage."""
        return self.rank // self.tp

    @property
    def is_first_stage(self) -> bool:
        """True on the stage that embeds tokens."""
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        """True on the stage that computes logits and samples."""
        return self.pp_rank == self.pp - 1

    @property
    def world_size(self) -> int:
        """tp * pp."""
        return self.tp * self.pp

    def layer_range(self, num_layers: int) -> range:
        """The layers this rank's stage runs: contiguous, earlier stages take the extras."""
        base, extra = divmod(num_layers, self.pp)
        start = self.pp_rank * base + min(self.pp_rank, extra)
        return range(start, start + base + (1 if self.pp_rank < extra else 0))


def init_parallel(tp: int, pp: int, rank: int, init_method: str, device_type: str) -> ParallelState:
    """Join the process group (when needed) and build this rank's tp group."""
    world_size = tp * pp
    if world_size == 1:
        return ParallelState()
    if not dist.is_initialized():
        backend = "nccl" if device_type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size)
    if dist.get_world_size() != world_size:
        raise EngineError(
            f"tp * pp = {world_size} but the process group has {dist.get_world_size()} ranks"
        )
    state = ParallelState(tp=tp, pp=pp, rank=dist.get_rank())
    for stage in range(pp):  # every rank must create every group, in the same order
        group = dist.new_group(list(range(stage * tp, (stage + 1) * tp)))
        if stage == state.pp_rank:
            state.tp_group = group
    return state


def tp_all_reduce(x: torch.Tensor, state: ParallelState) -> torch.Tensor:
    """Sum x over the tp group (in place); identity when tp == 1."""
    if state.tp > 1:
        dist.all_reduce(x, group=state.tp_group)
    return x


def tp_all_gather_last(x: torch.Tensor, state: ParallelState) -> torch.Tensor:
    """Concatenate x's last dim over the tp group; identity when tp == 1."""
    if state.tp == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(state.tp)]
    dist.all_gather(parts, x.contiguous(), group=state.tp_group)
    return torch.cat(parts, dim=-1)


def send_to_next_stage(x: torch.Tensor, state: ParallelState) -> None:
    """Send activations to the same tp rank of the next stage."""
    dist.send(x.contiguous(), dst=state.rank + state.tp)


def recv_from_prev_stage(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                         state: ParallelState) -> torch.Tensor:
    """Receive activations from the same tp rank of the previous stage."""
    x = torch.empty(shape, dtype=dtype, device=device)
    dist.recv(x, src=state.rank - state.tp)
    return x


def broadcast_tokens(token_ids: list[int], state: ParallelState, device: torch.device) -> list[int]:
    """Give every rank the tokens sampled on the last stage's first tp rank."""
    if state.pp == 1:
        return token_ids  # every tp rank sampled the same tokens from the same logits
    t = torch.tensor(token_ids if state.is_last_stage else [0] * len(token_ids),
                     dtype=torch.long, device=device)
    dist.broadcast(t, src=(state.pp - 1) * state.tp)
    return t.tolist()
