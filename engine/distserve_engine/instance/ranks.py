"""Where an instance's tp x pp ranks run: which ranks this process starts, and the rendezvous.

Decided before torch is imported (a process pins its cores first), so this module reads
only the settings file, the process's `--stage` and the environment. The instance's tp
and pp always come from the settings' `parallel` entry of its name (`--instance`); the
stage and the environment say only where this process sits among the ranks. Three ways
to be started:
- `distserve up` (nothing in the environment): this process is rank 0 and starts every
  other rank of its instance on this host, one slice of `--cpu-cores` each; the
  rendezvous is a free port on 127.0.0.1.
- A Kubernetes pod of one pipeline stage (`--stage S`; `MASTER_ADDR`, `MASTER_PORT`
  name stage 0's rendezvous, torch.distributed's own convention): this process is rank
  S * tp and starts the stage's other tp ranks; stage 0 serves the instance.
- One process per rank (`WORLD_SIZE`, `RANK`, `MASTER_ADDR`, `MASTER_PORT`, as torchrun
  sets them): this process is only its own rank.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from distserve_engine.server.settings import ServeSettings

DEFAULT_MASTER_PORT = 29500


@dataclass
class RankLayout:
    """The instance's tp x pp grid and the ranks this process runs."""

    tp: int = 1
    pp: int = 1
    first_rank: int = 0  # this process's rank; it starts first_rank+1 .. +num_local-1
    num_local: int = 1  # ranks on this host started by this process, itself included
    init_method: str = "env://"  # torch.distributed rendezvous

    @property
    def world_size(self) -> int:
        """tp * pp."""
        return self.tp * self.pp

    @property
    def is_driver(self) -> bool:
        """True on rank 0, the rank that runs the instance loop and its HTTP server."""
        return self.first_rank == 0

    @property
    def local_ranks(self) -> list[int]:
        """Ranks this process runs: its own first, then the children it starts."""
        return list(range(self.first_rank, self.first_rank + self.num_local))

    def split_cores(self, cores: list[int] | None) -> list[list[int] | None]:
        """Cores of each local rank: equal slices of `cores`, or all of them when too few."""
        if not cores:
            return [None] * self.num_local
        if len(cores) < self.num_local:
            return [list(cores)] * self.num_local
        size = len(cores) // self.num_local
        return [cores[i * size:(i + 1) * size] for i in range(self.num_local)]


def layout_for(config_path: str | Path, role: str, instance: str, stage: int | None = None,
               env: Mapping[str, str] | None = None) -> RankLayout:
    """This process's ranks: tp and pp from the settings' `parallel` entry of `instance`,
    its place among them from `stage` (a pod of one pipeline stage) or the environment."""
    env = os.environ if env is None else env
    settings = ServeSettings.load(config_path)
    tp, pp = 1, 1
    if role in ("prefill", "decode", "colocated"):
        parallel = settings.parallel_of(role, instance)
        tp, pp = parallel.tp, parallel.pp
    master = f"tcp://{env.get('MASTER_ADDR', '127.0.0.1')}:{env.get('MASTER_PORT', DEFAULT_MASTER_PORT)}"
    if stage is not None:  # one pod per pipeline stage, tp ranks in it
        if instance not in settings.parallel:
            raise ValueError(f"serve settings: parallel has no entry for instance {instance!r} "
                             f"(a pod of stage {stage} needs its instance's tp and pp)")
        if stage >= pp:
            raise ValueError(f"--stage {stage}: parallel.{instance}.pp is {pp}")
        return RankLayout(tp, pp, stage * tp, tp, master)
    if "WORLD_SIZE" in env and int(env["WORLD_SIZE"]) > 1:  # one process per rank
        if int(env["WORLD_SIZE"]) != tp * pp:
            raise ValueError(f"WORLD_SIZE {env['WORLD_SIZE']} != tp * pp = {tp * pp} of "
                             f"parallel.{instance}")
        return RankLayout(tp, pp, int(env.get("RANK", 0)), 1, master)
    if tp * pp == 1:
        return RankLayout()
    return RankLayout(tp, pp, 0, tp * pp, f"tcp://127.0.0.1:{free_port()}")


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
