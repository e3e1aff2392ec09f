"""A local reshuffle: from the running instances to a new plan's, losing no request.

Decides which processes stay, which start and which stop. Per role, a running instance
stays when the new plan has an instance of its tp and pp not yet matched (a mixed plan
has two shapes in a role); the rest of the new plan's instances are started, under new
names, the rest of the old stopped. In order:
1. the new instances start, reading their own settings file (`serve-rN.json`, the new
   plan with its `parallel` keyed by the names of the processes that serve it), and are
   waited for until they serve;
2. the router's file is rewritten: the new peers, the leaving ones marked draining (no
   new request; in-flight ones finish), the new plan and limits; the router re-reads it
   (`server/peers.py`) and is waited for until it sees the new instances healthy;
3. once the router has dropped every draining instance (it drops one with nothing in
   flight), their processes stop and the file is written without them.

# NOTE: on one machine cores can be shared, so the new instances start before the old
# stop and capacity never dips; on a cluster without free GPUs the operator's reshuffle
# drains first (`k8s/`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from distserve.local.launcher import LocalLauncher, ServerProcess
from distserve.local.settings import local_instance_name
from distserve_engine.server.settings import Parallelism, ServeSettings

ROLES = ("prefill", "decode", "colocated")
ADOPT_TIMEOUT_S = 60.0  # the router re-reads its file every 2 s and polls health every second
DRAIN_TIMEOUT_S = 300.0  # longest a leaving instance may take to finish its requests
POLL_S = 0.5


@dataclass(frozen=True)
class ReshuffleReport:
    """What a reshuffle did: instance names started, kept and stopped; seconds it drained."""

    started: tuple[str, ...]
    kept: tuple[str, ...]
    stopped: tuple[str, ...]
    drain_s: float

    def describe(self) -> str:
        """One line for the log."""
        return (f"started {', '.join(self.started) or 'none'}; kept {', '.join(self.kept) or 'none'}; "
                f"stopped {', '.join(self.stopped) or 'none'} (drained in {self.drain_s:.1f} s)")


def split_instances(procs: list[ServerProcess], new: ServeSettings
                    ) -> tuple[list[ServerProcess], list[ServerProcess], list[tuple[str, Parallelism]]]:
    """(kept, leaving, (role, tp x pp) of each instance to start) from the running
    processes and the new settings, which name instances as `distserve up` does."""
    kept, leaving, to_start = [], [], []
    for role in ROLES:
        wanted = [new.parallel_of(role, local_instance_name(role, i))
                  for i in range(new.instances.get(role, 0))]
        for proc in (p for p in procs if p.role == role):
            if proc.parallel in wanted:
                wanted.remove(proc.parallel)
                kept.append(proc)
            else:
                leaving.append(proc)
        to_start += [(role, shape) for shape in wanted]
    return kept, leaving, to_start


def reshuffle(launcher: LocalLauncher, settings: ServeSettings,
              progress: Callable[[str], None] = print,
              drain_timeout_s: float = DRAIN_TIMEOUT_S) -> ReshuffleReport:
    """Move the launcher's deployment to `settings` (a whole serve settings document:
    instances, parallel, plan); see the module docstring for the order."""
    kept, leaving, to_start = split_instances(launcher.procs[:-1], settings)
    names = {role: iter(launcher.next_instance_names(role, sum(r == role for r, _ in to_start)))
             for role in ROLES}
    name_to_role = {next(names[role]): (role, shape) for role, shape in to_start}
    # The new processes' file names each by the name it runs under.
    started_settings = dataclasses.replace(
        settings, parallel={name: shape for name, (_, shape) in name_to_role.items()})
    revision = len(list(launcher.workdir.glob("serve-r*.json")))
    config_path = launcher.workdir / f"serve-r{revision}.json"
    started_settings.write(config_path)
    started = [launcher.add_instance(role, config_path, name)
               for name, (role, _) in name_to_role.items()]
    for proc in started:
        launcher.wait_ready(proc)
        progress(f"reshuffle: {proc.name} ready at {proc.url} (cores {proc.cores or 'any'})")
    launcher.settings = settings
    launcher.write_router_settings(settings, draining=tuple(leaving))
    _wait(lambda: all(router_instances(launcher.url).get(p.name) == 1.0 for p in started),
          ADOPT_TIMEOUT_S, "the router to adopt the new instances")
    if leaving:
        progress(f"reshuffle: draining {', '.join(p.name for p in leaving)}")
    drain_started_s = time.monotonic()
    is_drained = _wait(lambda: not set(router_instances(launcher.url)) & {p.name for p in leaving},
                       drain_timeout_s, "the leaving instances to drain")
    drain_s = time.monotonic() - drain_started_s
    if not is_drained:
        progress(f"reshuffle: not drained after {drain_timeout_s:.0f} s; stopping them anyway")
    for proc in leaving:
        launcher.stop_process(proc)
    launcher.write_router_settings(settings)
    return ReshuffleReport(tuple(p.name for p in started), tuple(p.name for p in kept),
                           tuple(p.name for p in leaving), drain_s)


def router_instances(url: str) -> dict[str, float]:
    """Instance name -> the router's `distserve_instance_healthy` (1.0 serving); {} when
    the router does not answer."""
    try:
        text = httpx.get(f"{url}/metrics", timeout=5.0).text
    except httpx.HTTPError:
        return {}
    out = {}
    for line in text.splitlines():
        if line.startswith("distserve_instance_healthy{") and 'instance="' in line:
            name = line.split('instance="', 1)[1].split('"', 1)[0]
            out[name] = float(line.rsplit(" ", 1)[1])
    return out


def _wait(predicate: Callable[[], bool], timeout_s: float, what: str) -> bool:
    """Poll `predicate` until it holds (True) or `timeout_s` passes (False)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(POLL_S)
    return False
