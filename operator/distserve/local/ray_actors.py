"""Serving processes as Ray actors: each actor runs one `distserve_engine.server`.

An instance actor asks Ray for its own `tp * pp` GPUs on a GPU deployment (Ray chooses
which, and sets the actor's CUDA_VISIBLE_DEVICES), or that many CPUs (and pins its ranks
to their cores with `--cpu-cores`) on the CPU; the router actor asks for none. Ray
is imported only here, when `distserve up --backend ray` or `--ray-address` is used.
"""

from __future__ import annotations

import os
from typing import Any

from distserve_engine.server.settings import ServeSettings

os.environ.setdefault("RAY_AUTH_MODE", "disabled")


def _server_actor_class(ray: Any) -> Any:
    @ray.remote
    class ServerActor:
        """Runs `python -m distserve_engine.server ARGV` inside the actor's process."""

        def run(self, argv: list[str]) -> int:
            from distserve_engine.server.__main__ import main

            return main(argv)

    return ServerActor


class RayServers:
    """Spawns and kills server actors on a local or existing Ray cluster."""

    def __init__(self, address: str | None, settings: ServeSettings) -> None:
        import ray

        self.ray = ray
        self.is_owner = not ray.is_initialized()
        if self.is_owner:
            if address:
                ray.init(address=address)
            else:
                # One CPU per pinned instance: as many as this process may run on.
                ray.init(num_cpus=max(2, len(os.sched_getaffinity(0))), include_dashboard=False,
                         log_to_driver=False)
        self.actor_class = _server_actor_class(ray)
        self.is_gpu = settings.engine.device_type == "cuda"
        self._proc_to_ref: dict[str, Any] = {}

    def spawn(self, proc: Any) -> Any:
        """Start the actor and its server; return the actor handle."""
        if proc.role == "router":
            options = {"num_cpus": 0}
        elif self.is_gpu:
            options = {"num_cpus": 0, "num_gpus": proc.parallel.num_ranks}
        else:
            options = {"num_cpus": proc.parallel.num_ranks}
        actor = self.actor_class.options(name=f"distserve-{proc.name}", **options).remote()
        self._proc_to_ref[proc.name] = actor.run.remote(proc.argv)
        return actor

    def is_alive(self, proc: Any) -> bool:
        """False once the actor's server returned or the actor died."""
        ref = self._proc_to_ref.get(proc.name)
        if ref is None:
            return False
        ready, _ = self.ray.wait([ref], timeout=0)
        return not ready

    def kill(self, proc: Any) -> None:
        """Kill the actor (its server dies with it)."""
        self.ray.kill(proc.handle)
        self._proc_to_ref.pop(proc.name, None)

    def shutdown(self) -> None:
        """Disconnect from Ray; stop it if this launcher started it."""
        if self.is_owner:
            self.ray.shutdown()
