"""Which latency profile `distserve up` plans with, and the per-machine cache of measured ones.

A profile's timings hold only on a machine like the one that measured them, so on the
CPU `distserve up` plans with this machine's own profile. The order:

1. `--profile FILE`, as given;
2. this machine's cached profile (`$XDG_CACHE_HOME/distserve/profiles/`, default
   `~/.cache`): one file per key of what the timings depend on (model, weights, dtype,
   block size, context cap, the grid's bounds, threads per rank, CPU model and core
   count, torch version, the engine's C kernels' source), so a change of any of them
   measures anew;
3. unless `--no-measure`, measure it now with `distserve profile`'s code (a minute or
   more, once) and cache it;
4. the spec's `planner.profilePath`, with a plain warning when the file records another
   machine (or none), else the planner's built-in tables.

On a GPU nothing is measured: the profiler times tp 1 only, which would bar the planner
from tensor parallelism; the spec's or the built-in profile is used, and named.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from distserve.local.machine import Machine
from distserve.spec import DistServeDeploymentSpec
from distserve_engine.config import EngineConfig

CACHE_FORMAT = 6  # bump when the profiler's output changes meaning, or the engine's CPU
# speed changes outside its C kernels: old entries are ignored (2: oneDNN-blocked linears;
# 3: decode batches of 3 x 2^k timed too; 4: decode linears on packed panels; 5: dtype
# "auto" is bfloat16 on a CPU with bfloat16 instructions; 6: prefill lengths between the
# powers of two timed too)
THREADS_PER_RANK = 1  # `distserve up` pins each instance rank to one core


@dataclass(frozen=True)
class ProfileSource:
    """The profile the planner reads, and where and when it was measured."""

    path: str | None  # None: no file, the planner's built-in tables or analytic model
    origin: str  # "--profile", "cached", "measured", "spec" or "none"
    machine: Machine | None  # what the file records, None if it records nothing
    measured_at: str | None  # the file's provenance.date
    is_this_machine: bool

    def describe(self) -> str:
        """For a user: the file, the machine it was measured on and when; how it was chosen."""
        if self.path is None:
            return "none (the planner's built-in tables where they cover the model, else its analytic model)"
        when = f"on {self.measured_at}" if self.measured_at else "at an unrecorded date"
        where = ("an unrecorded machine" if self.machine is None
                 else f"{'this' if self.is_this_machine else 'another'} machine: {self.machine.describe()}")
        if self.origin == "measured":
            return f"{self.path} (measured just now on {where}; cached for later runs)"
        origin = {"--profile": "given by --profile", "cached": "cached",
                  "spec": "the spec's planner.profilePath"}[self.origin]
        return f"{self.path} ({origin}; measured {when} on {where})"


# The engine settings a step's latency depends on (not, e.g., the KV budget).
KEY_ENGINE_FIELDS = ("model", "device", "dtype", "block_size", "max_model_len", "seed")


def cache_dir() -> Path:
    """Where measured profiles are kept: $XDG_CACHE_HOME/distserve/profiles."""
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "distserve" / "profiles"


def cache_key(spec: DistServeDeploymentSpec, engine: EngineConfig, machine: Machine) -> dict:
    """Everything a measured profile depends on (`engine`: the serving settings' engine)."""
    return {
        "format": CACHE_FORMAT, "model": spec.model.name,
        "engine": {name: getattr(engine, name) for name in KEY_ENGINE_FIELDS},
        "max_prefill_tokens": spec.planner.max_prefill_tokens,
        "max_decode_batch": spec.planner.max_decode_batch,
        "device": machine.device, "threads": machine.threads, "cpu_model": machine.cpu_model,
        "cpu_cores": machine.cpu_cores, "torch": machine.torch,
        "cpu_kernels": _kernels_digest(),
    }


def _kernels_digest() -> str | None:
    """A digest of the engine's C kernels' source (read as a file: the engine's modules
    import torch, which the operator does not)."""
    spec = importlib.util.find_spec("distserve_engine")
    folders = spec.submodule_search_locations if spec is not None else None
    source = Path(next(iter(folders))) / "cpu_kernels.c" if folders else None
    if source is None or not source.exists():
        return None
    return hashlib.sha256(source.read_bytes()).hexdigest()[:12]


def cache_path(key: dict) -> Path:
    """The cache file of a key: <model>-<device>-<threads>t-<hash of the key>.json."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    name = Path(key["model"])
    name = name.parent if name.suffix in (".json", ".gguf") else name  # a config or weights file
    model = re.sub(r"[^a-z0-9.]+", "-", name.name.lower()).strip("-")
    return cache_dir() / f"{model or 'model'}-{key['device']}-{key['threads']}t-{digest}.json"


def read_source(path: str | Path, origin: str, here: Machine) -> ProfileSource:
    """Describe a profile file; ValueError names the file when it is not a readable profile."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: cannot read a latency profile: {err}") from None
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: a latency profile is a JSON object")
    machine = Machine.of_profile(doc)
    date = (doc.get("provenance") or {}).get("date")
    return ProfileSource(str(path), origin, machine, date,
                         machine is not None and machine.matches(here))


def choose_profile(spec: DistServeDeploymentSpec, engine: EngineConfig, given: str | None,
                   can_measure: bool, measure: Callable[[Path, dict], None],
                   say: Callable[[str], None]) -> ProfileSource:
    """The profile to plan with (the module docstring's order). `measure(path, key)`
    writes this machine's profile to path; when it raises, the spec's profile is used
    with a warning. ValueError names `--profile` or the spec's field when the file given
    there is not a readable profile."""
    here = Machine.here(engine.device, THREADS_PER_RANK)
    if given:
        try:
            return read_source(given, "--profile", here)
        except ValueError as err:
            raise ValueError(f"--profile: {err}") from None
    if here.device != "cpu":
        return _spec_source(spec, here)
    key = cache_key(spec, engine, here)
    path = cache_path(key)
    if path.is_file():
        try:
            return read_source(path, "cached", here)
        except ValueError as err:  # e.g. a file cut short by a full disk: measure again
            say(f"warning: ignoring the cached profile: {err}")
    if not can_measure:
        return _spec_source(spec, here, say, "without --no-measure, `distserve up` measures "
                            "this machine once (a minute or more) and caches it")
    say(f"measuring this machine's latency profile ({here.describe()}): first use here, once, "
        f"a minute or more; cached in {path}. `--profile FILE` or `--no-measure` skips this")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        measure(path, key)
    except (RuntimeError, OSError, ValueError) as err:  # ValueError: a model it cannot load
        say(f"warning: could not measure this machine's profile: {err}")
        return _spec_source(spec, here, say, "`distserve profile` shows why the measurement failed")
    return read_source(path, "measured", here)


def _spec_source(spec: DistServeDeploymentSpec, here: Machine,
                 say: Callable[[str], None] | None = None, hint: str = "") -> ProfileSource:
    """The spec's profile (or none); with `say`, a warning when it is not this machine's."""
    if not spec.planner.profile_path:
        if say:
            say("warning: no profile of this machine and none in the spec: the planner "
                f"predicts with its analytic model, which may be far off on a CPU; {hint}")
        return ProfileSource(None, "none", None, None, False)
    try:
        source = read_source(spec.planner.profile_path, "spec", here)
    except ValueError as err:
        raise ValueError(f"spec.planner.profilePath: {err}") from None
    if say and not source.is_this_machine:
        measured_on = source.machine.describe() if source.machine else "an unrecorded machine"
        say(f"warning: predictions come from {source.path}, measured on {measured_on}, not on "
            f"this machine ({here.describe()}); they may be far off. {hint[0].upper()}{hint[1:]}")
    return source
