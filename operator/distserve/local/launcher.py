"""Starts and stops the serving processes of one local deployment.

Each instance is one `python -m distserve_engine.server --role ROLE` process, pinned to
its own CPU cores (or given its GPUs), and the router is one more in front of them,
serving the OpenAI API. An instance of tp x pp ranks (its entry in the settings'
`parallel`; the instances of a role may differ) gets one core per rank, and its process
starts its other ranks itself (`instance/workers.py`). On CUDA each instance process sees
only the GPUs its plan gives it (CUDA_VISIBLE_DEVICES, `process_env`), in stage order,
and rank r takes the r-th of them.
Two ways to run those processes: plain child processes
(`backend="process"`), or Ray actors (`backend="ray"`, also `--ray-address` to join a
cluster), each actor running the same server. Everything started is stopped by
`stop()` (also on Ctrl-C), in reverse order, and the work folder (settings and logs)
is removed with them.

Once started, a supervisor thread watches the processes: one that dies is started again
(after 1 s, then twice as long after each death in a row, at most 30 s) on the same port,
and the router, which polls its instances' health, sends it work again once it serves.

The router reads its peers from its settings file (`serve.json`), not from its command
line, so the peers can change while it runs (`server/peers.py` re-reads the file):
`local/reshuffle.py` starts new instances (`add_instance`), rewrites the router's file
(`write_router_settings`) and stops the drained ones (`stop_process`). Instances read
their own copy (`serve-r0.json`, then one per reshuffle), so a restarted instance keeps
the tp and pp it was started with.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from distserve_engine.server.settings import Parallelism, Peer, ServeSettings

READY_TIMEOUT_S = 300.0  # loading a model on two shared cores can take a while
STOP_TIMEOUT_S = 10.0
SUPERVISE_INTERVAL_S = 0.5
RESTART_BACKOFF_S = (1.0, 30.0)  # first delay, longest delay
STABLE_AFTER_S = 60.0  # a process up this long has its backoff reset


class LaunchError(RuntimeError):
    """A process did not come up; the message holds the tail of its log."""


@dataclass
class ServerProcess:
    """One serving process: its role, name, port, pinning and command line."""

    role: str
    name: str
    port: int
    cores: list[int] | None
    argv: list[str] = field(default_factory=list)
    gpu_ids: tuple[int, ...] | None = None  # the GPUs it may see; None: every GPU
    parallel: Parallelism = field(default_factory=Parallelism)  # its ranks, as its file says
    log_path: Path | None = None
    handle: Any = None  # subprocess.Popen, or a Ray actor

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def process_env(proc: ServerProcess, base: dict[str, str]) -> dict[str, str]:
    """The environment of `proc`: `base`, unbuffered output, and its GPUs when it has some."""
    env = {**base, "PYTHONUNBUFFERED": "1"}
    if proc.gpu_ids is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, proc.gpu_ids))
    return env


def cores_from(first_core: int, count: int, num_cores: int) -> list[int] | None:
    """`count` cores from `first_core` on, round the machine; None when not pinning."""
    return sorted({(first_core + r) % num_cores for r in range(count)}) if num_cores else None


def instance_argv(proc: ServerProcess, config_path: Path) -> list[str]:
    """The command line of one instance process."""
    argv = ["--config", str(config_path), "--role", proc.role, "--instance", proc.name,
            "--host", "127.0.0.1", "--port", str(proc.port)]
    if proc.cores is not None:
        argv += ["--cpu-cores", ",".join(map(str, proc.cores))]
    return argv


def peers_of(procs: list[ServerProcess],
             draining: tuple[ServerProcess, ...] = ()) -> dict[str, list[Peer]]:
    """The router's `peers`: every instance process by role, `draining` ones marked."""
    peers: dict[str, list[Peer]] = {}
    for proc in procs:
        if proc.role != "router":
            peer = Peer(proc.name, proc.url, draining=proc in draining)
            peers.setdefault(proc.role, []).append(peer)
    return peers


def plan_processes(settings: ServeSettings, config_path: Path, host: str, port: int,
                   num_cores: int, instance_config_path: Path | None = None,
                   name_to_gpu_ids: dict[str, tuple[int, ...]] | None = None
                   ) -> list[ServerProcess]:
    """The instance processes (ports port+1, ...) then the router on `port`; the router
    reads `config_path`, the instances `instance_config_path` (default the same file).
    `name_to_gpu_ids`: the GPUs of each instance (`local.settings.instance_gpu_ids`)."""
    procs: list[ServerProcess] = []
    next_core = 0
    for role in ("prefill", "decode", "colocated"):
        for i in range(settings.instances.get(role, 0)):
            name = f"{role}-{i}"
            parallel = settings.parallel_of(role, name)
            cores = cores_from(next_core, parallel.num_ranks, num_cores)
            next_core += parallel.num_ranks if num_cores else 0
            procs.append(ServerProcess(role, name, port + 1 + len(procs), cores,
                                       gpu_ids=(name_to_gpu_ids or {}).get(name),
                                       parallel=parallel))
    for proc in procs:
        proc.argv = instance_argv(proc, instance_config_path or config_path)
    router = ServerProcess("router", "router-0", port, None)
    router.argv = ["--config", str(config_path), "--role", "router", "--instance", "router-0",
                   "--host", host, "--port", str(port)]
    return [*procs, router]


class LocalLauncher:
    """Runs one deployment's processes; a context manager."""

    def __init__(self, settings: ServeSettings, host: str = "127.0.0.1", port: int = 8000,
                 backend: str = "process", ray_address: str | None = None,
                 pin_cores: bool = True,
                 name_to_gpu_ids: dict[str, tuple[int, ...]] | None = None) -> None:
        self.settings = settings
        self.host, self.port = host, port
        self.backend = backend
        self.ray_address = ray_address
        self.workdir = Path(tempfile.mkdtemp(prefix="distserve-up-"))
        self.config_path = self.workdir / "serve.json"  # the router's (with its peers)
        self.num_cores = len(os.sched_getaffinity(0)) if pin_cores else 0
        self.procs = plan_processes(settings, self.config_path, host, port, self.num_cores,
                                    self.workdir / "serve-r0.json", name_to_gpu_ids)
        self.next_core = sum(len(p.cores or ()) for p in self.procs)
        self._ray = None
        self.restarts: dict[str, int] = {}  # process name -> times the supervisor restarted it
        self._stopping = threading.Event()
        self._lock = threading.Lock()  # a restart and a reshuffle's stop do not interleave
        self._supervisor: threading.Thread | None = None

    @property
    def url(self) -> str:
        """The OpenAI API's base URL."""
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> LocalLauncher:
        try:
            self.start()
        except BaseException:  # __exit__ does not run when __enter__ raises
            self.stop()
            raise
        return self

    def __exit__(self, *_: Any) -> None:
        self.stop()

    def start(self, progress: Any = print) -> None:
        """Start the instances, wait until they serve, then the router."""
        self.settings.write(self.workdir / "serve-r0.json")
        self.write_router_settings(self.settings)
        if self.backend == "ray":
            from distserve.local.ray_actors import RayServers

            self._ray = RayServers(self.ray_address, self.settings)
        instances, router = self.procs[:-1], self.procs[-1]
        for proc in instances:
            self._spawn(proc)
        for proc in instances:
            self._wait_ready(proc, "/health")
            progress(f"{proc.name} ready at {proc.url} (cores {proc.cores or 'any'})")
        self._spawn(router)
        self._wait_ready(router, "/health")
        progress(f"router ready: OpenAI API at http://{self.host}:{self.port}/v1")
        self._supervisor = threading.Thread(target=self._supervise, args=(progress,),
                                            name="supervisor", daemon=True)
        self._supervisor.start()

    def _supervise(self, progress: Any) -> None:
        """Restart a process that died, with a backoff per process (see the module's docstring)."""
        name_to_delay_s: dict[str, float] = {}
        name_to_started_s = {proc.name: time.monotonic() for proc in self.procs}
        while not self._stopping.wait(SUPERVISE_INTERVAL_S):
            for proc in self.procs:  # NOTE: a reshuffle swaps the list, never mutates it
                if self._stopping.is_set() or proc.handle is None or self._is_alive(proc):
                    continue
                if time.monotonic() - name_to_started_s.get(proc.name, 0.0) > STABLE_AFTER_S:
                    name_to_delay_s.pop(proc.name, None)
                delay_s = name_to_delay_s.get(proc.name, RESTART_BACKOFF_S[0])
                name_to_delay_s[proc.name] = min(2 * delay_s, RESTART_BACKOFF_S[1])
                progress(f"{proc.name} exited ({self._exit_code(proc)}); restarting in {delay_s:.0f} s")
                if self._stopping.wait(delay_s):
                    return
                with self._lock:
                    if proc not in self.procs or proc.handle is None:  # stopped by a reshuffle
                        continue
                    self._spawn(proc, is_restart=True)
                name_to_started_s[proc.name] = time.monotonic()
                self.restarts[proc.name] = self.restarts.get(proc.name, 0) + 1

    def write_router_settings(self, settings: ServeSettings,
                              draining: tuple[ServerProcess, ...] = ()) -> None:
        """Write the router's file: `settings` with the running instances as its peers
        (those in `draining` marked so); replaced atomically, so the router never reads half."""
        doc = dataclasses.replace(settings, peers=peers_of(self.procs, draining))
        partial = self.config_path.with_suffix(".json.partial")
        doc.write(partial)
        os.replace(partial, self.config_path)

    def next_instance_names(self, role: str, count: int) -> list[str]:
        """Names for `count` more instances of `role`, after every name in use."""
        first = 1 + max((int(p.name.rpartition("-")[2]) for p in self.procs if p.role == role),
                        default=-1)
        return [f"{role}-{first + i}" for i in range(count)]

    def add_instance(self, role: str, config_path: Path, name: str | None = None) -> ServerProcess:
        """Start one more instance of `role` reading `config_path` (its tp and pp under
        `name`; default the next free name), on a free port and the next cores; it is in
        `procs` (before the router) once this returns."""
        name = name or self.next_instance_names(role, 1)[0]
        parallel = ServeSettings.load(config_path).parallel_of(role, name)
        port = max(p.port for p in self.procs) + 1
        while not _is_port_free(port):
            port += 1
        proc = ServerProcess(role, name, port,
                             cores_from(self.next_core, parallel.num_ranks, self.num_cores),
                             parallel=parallel)
        self.next_core += parallel.num_ranks if self.num_cores else 0
        proc.argv = instance_argv(proc, config_path)
        with self._lock:
            self._spawn(proc)
            self.procs = [*self.procs[:-1], proc, self.procs[-1]]
        return proc

    def wait_ready(self, proc: ServerProcess) -> None:
        """Until `proc` answers /health; LaunchError when it exits or takes too long."""
        self._wait_ready(proc, "/health")

    def stop_process(self, proc: ServerProcess) -> None:
        """Stop one instance process for good (the supervisor does not restart it)."""
        with self._lock:  # out of `procs` first: the supervisor then leaves it dead
            self.procs = [p for p in self.procs if p is not proc]
        if proc.handle is not None:
            if self._ray is not None:
                self._ray.kill(proc)
            else:
                _terminate(proc.handle)
            proc.handle = None

    def _exit_code(self, proc: ServerProcess) -> str:
        if self._ray is not None:
            return "actor died"
        return f"exit code {proc.handle.returncode}"

    def _spawn(self, proc: ServerProcess, is_restart: bool = False) -> None:
        proc.log_path = self.workdir / f"{proc.name}.log"
        if self._ray is not None:
            proc.handle = self._ray.spawn(proc)
            return
        env = process_env(proc, dict(os.environ))
        with open(proc.log_path, "ab" if is_restart else "wb") as log:
            proc.handle = subprocess.Popen(
                [sys.executable, "-m", "distserve_engine.server", *proc.argv],
                stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def _is_alive(self, proc: ServerProcess) -> bool:
        if self._ray is not None:
            return self._ray.is_alive(proc)
        return proc.handle.poll() is None

    def _wait_ready(self, proc: ServerProcess, path: str) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if not self._is_alive(proc):
                raise LaunchError(f"{proc.name} exited while starting:\n{self._log_tail(proc)}")
            try:
                if httpx.get(proc.url + path, timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise LaunchError(f"{proc.name} not ready after {READY_TIMEOUT_S:.0f} s:\n{self._log_tail(proc)}")

    def _log_tail(self, proc: ServerProcess, num_lines: int = 30) -> str:
        if proc.log_path is None or not proc.log_path.exists():
            return "(no log)"
        return "\n".join(proc.log_path.read_text(errors="replace").splitlines()[-num_lines:])

    def stop(self) -> None:
        """Stop every process started, router first, then remove the work folder."""
        self._stopping.set()
        if self._supervisor is not None:
            self._supervisor.join(timeout=RESTART_BACKOFF_S[1] + 5)
        try:
            for proc in reversed(self.procs):
                if proc.handle is None:
                    continue
                if self._ray is not None:
                    self._ray.kill(proc)
                else:
                    _terminate(proc.handle)
                proc.handle = None
            if self._ray is not None:
                self._ray.shutdown()
                self._ray = None
        finally:
            # NOTE: the logs go with it; a process that fails to start has its log's tail
            # in the LaunchError message, printed before this runs.
            shutil.rmtree(self.workdir, ignore_errors=True)


def _is_port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _terminate(popen: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL after STOP_TIMEOUT_S."""
    if popen.poll() is not None:
        return
    popen.terminate()
    try:
        popen.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        popen.kill()
        popen.wait()
