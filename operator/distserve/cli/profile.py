"""`distserve profile -f SPEC [-o FILE]`: measure the engine here and write a latency profile.

Loads the spec's model into the engine exactly as `distserve up` would (same dtype,
block size, context cap and KV budget), times prefill batches and decode steps with the
engine's hardware profiler (`distserve_engine.profile`), and writes the fitted
coefficients in the shape of the authors' `a100-opt-profile.json`: keyed by the
catalog's model id at tp 1, for the spec's accelerator, under both engines (the
colocated baseline runs the same runner here). Point `planner.profilePath` at the file.
The engine is imported only when the command runs: the operator's image has no torch.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from distserve.catalog import get_accelerator, get_model
from distserve.local.machine import cpu_model, torch_version
from distserve.spec import DistServeDeploymentSpec, SpecError, load_manifest

NAME = "profile"
HELP = "Measure prefill and decode latency of the spec's model on this machine; write a profile."
EXIT_PROFILE_ERROR = 1
DEFAULT_PREFILL_TOKENS = {"cpu": 512, "cuda": 2048}
ROW_MS_DIGITS = 4  # a tenth of a microsecond: sub-millisecond rows keep their fit error readable
FORMULAS = {
    "prefill_ms": "a + b*S1 + c*S2, where S1 is the sum of the prompt lengths in the batch "
                  "and S2 the sum of their squares",
    "decode_ms": "a + b*T + c*B, where B is the batch size, T the sum over the batch of "
                 "(tokens already in context + 1), and (a, b, c) is decode_small_batch_abc "
                 "when B < large_batch_from, else decode_large_batch_abc",
}


def add_arguments(parser) -> None:
    """Options of `distserve profile`."""
    parser.add_argument("-f", "--file", required=True, metavar="SPEC",
                        help="DistServeDeployment YAML manifest (model, accelerator, engine)")
    parser.add_argument("-o", "--output", metavar="FILE", default=None,
                        help="profile JSON to write (default: <model>-<accelerator>-profile.json)")
    parser.add_argument("--threads", type=int, default=1, metavar="N",
                        help="CPU threads (default 1: `distserve up` pins each instance to a core)")
    parser.add_argument("--repeats", type=int, default=3, metavar="N",
                        help="timed runs per point, the median kept (default 3)")


class ProfileError(RuntimeError):
    """Profiling could not run or failed; the message says why."""


def run(args) -> int:
    """Profile, fit, write; exit 1 when the output cannot be written or the engine fails."""
    spec = load_manifest(args.file).spec
    model, accelerator = _catalog_names(spec)
    output = Path(args.output or f"{model.split('/')[-1].lower()}-{accelerator.lower()}-profile.json")
    problem = _unwritable(output) or (
        f"--threads: must be >= 1, got {args.threads}" if args.threads < 1 else None
    ) or (f"--repeats: must be >= 1, got {args.repeats}" if args.repeats < 1 else None)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return EXIT_PROFILE_ERROR
    command = "distserve profile " + " ".join(shlex.quote(a) for a in sys.argv[2:]) \
        if sys.argv[1:2] == ["profile"] else f"distserve profile -f {args.file}"
    try:
        measured = measure_profile(spec, output, command, args.threads, args.repeats)
    except ProfileError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_PROFILE_ERROR
    print(_summary(measured, output))
    return 0


def measure_profile(spec: DistServeDeploymentSpec, output: Path, command: str, threads: int = 1,
                    repeats: int = 3, progress: Callable[[str], None] | None = None,
                    extra_provenance: dict | None = None) -> Any:
    """Measure the spec's model here and write the profile file to `output` (whole or not
    at all: an interrupted run leaves no file). Returns the engine's `HardwareProfile`;
    ProfileError when the engine is missing or fails."""
    say = progress or (lambda message: print(message, file=sys.stderr, flush=True))
    model, accelerator = _catalog_names(spec)
    load_before = os.getloadavg()
    try:
        measured = _measure(spec, threads, repeats, say)
    except ImportError as err:
        raise ProfileError(f"the profiler needs the engine (pip install 'distserve[engine]'): {err}") from None
    except (ValueError, RuntimeError, OSError) as err:  # EngineError is a ValueError
        raise ProfileError(f"profiling failed: {err}") from None
    provenance = _provenance(command, measured, load_before) | (extra_provenance or {})
    doc = profile_document(measured, model, accelerator, provenance)
    partial = output.with_name(f".{output.name}.partial")
    partial.write_text(json.dumps(doc, indent=1) + "\n")
    os.replace(partial, output)
    return measured


def _catalog_names(spec: DistServeDeploymentSpec) -> tuple[str, str]:
    """The model id and accelerator name the planner keys profiles on."""
    try:
        model = get_model(spec.model.name).name
    except ValueError as err:
        raise SpecError(f"spec.model.name: {err}") from None
    try:
        accelerator = get_accelerator(spec.cluster.accelerator).name
    except ValueError as err:
        raise SpecError(f"spec.cluster.accelerator: {err}") from None
    return model, accelerator


def _unwritable(output: Path) -> str | None:
    """Why the output cannot be written, checked before minutes of profiling; None if it can."""
    folder = output.parent if str(output.parent) else Path(".")
    if output.is_dir():
        return f"{output}: is a folder, not a file"
    if not folder.is_dir():
        return f"{output}: folder {folder} does not exist"
    if not os.access(folder, os.W_OK) or (output.exists() and not os.access(output, os.W_OK)):
        return f"{output}: not writable"
    return None


def _measure(spec: DistServeDeploymentSpec, threads: int, repeats: int,
             say: Callable[[str], None]) -> Any:
    """Run the engine's profiler on the engine settings `distserve up` would use."""
    from distserve.local.settings import engine_config, engine_device, find_model_path
    from distserve_engine.profile import ProfileGrid, profile_model

    device = engine_device(spec)
    config = engine_config(spec, find_model_path(spec))
    max_context = min(512, (config.max_model_len or 2048) // 2)
    grid = ProfileGrid.default(
        max_prefill_tokens=spec.planner.max_prefill_tokens or DEFAULT_PREFILL_TOKENS[config.device_type],
        max_decode_batch=spec.planner.max_decode_batch, max_context_len=max_context, repeats=repeats,
    )
    say(f"profiling {spec.model.name} on {device} ({threads} thread(s)): "
        f"{len(grid.prefill_batches)} prefill batches, "
        f"{len(grid.decode_batch_sizes) * len(grid.decode_context_lens)} decode points")
    return profile_model(config, grid, threads if device == "cpu" else None, progress=say)


def profile_document(measured: Any, model: str, accelerator: str, provenance: dict) -> dict:
    """The profile file: the a100-opt-profile.json shape plus provenance and the raw timings."""
    entry = {"1": measured.fit_entry()}
    return {
        "about": f"{model} on {accelerator}: {provenance['about']}",
        "accelerator": accelerator,
        "device": provenance["device"],
        "provenance": {k: v for k, v in provenance.items() if k not in ("about", "device")},
        "formulas": FORMULAS,
        "fit_error": {
            "prefill": vars(measured.prefill_error), "decode": vars(measured.decode_error),
        },
        "engines": {
            "disaggregated": {"about": "the engine's runner, measured", "models": {model: entry}},
            "colocated": {"about": "the same runner (a colocated instance batches the same "
                                   "way); mixed iterations are not measured", "models": {model: entry}},
        },
        "kv_capacity": {
            "about": "tokens of KV cache an instance allocates here (the engine's KV budget)",
            "rows": [{"model": model, "tp": 1, "pp": 1,
                      "kv_capacity_tokens": measured.kv_capacity_tokens}],
        },
        "measurements": {
            "prefill": [_timing_row(t, "S1", "S2") for t in measured.prefill_timings],
            "decode": [_timing_row(t, "T", "B") for t in measured.decode_timings],
        },
    }


def _timing_row(timing: Any, x1: str, x2: str) -> dict:
    return {"what": timing.label, x1: timing.x1, x2: timing.x2, "ms": round(timing.ms, ROW_MS_DIGITS)}


def _provenance(command: str, measured: Any, load_before: tuple[float, float, float]) -> dict:
    """Who measured what, where, when and under what load (the numbers depend on all four)."""
    import torch

    load = [round(x, 2) for x in os.getloadavg()]
    load_1min = f"{load_before[0]:.2f} at the start, {load[0]:.2f} at the end"
    cpu = cpu_model()
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    # NOTE: `distserve up` reads this section back (`distserve.local.machine`) to tell
    # whether a profile was measured on the machine that serves.
    device = {"type": measured.device, "threads": measured.threads, "cpu_model": cpu,
              "cpu_cores": os.cpu_count(), "torch": torch_version()}  # as `up` reads this machine's
    if measured.device.startswith("cuda"):
        device["gpu_model"] = torch.cuda.get_device_name(measured.device)
    where = device.get("gpu_model") or f"{measured.threads} thread(s) of {cpu}"
    return {
        "about": f"Latency measured by `{command}` on {date} on {where} ({os.cpu_count()} cores, "
                 f"1-minute load average {load_1min}, host {platform.node() or 'unknown'}). "
                 "Times are milliseconds. They depend on the machine and its load: re-measure "
                 "on the machine that serves.",
        "command": command, "date": date,
        "load_average_1_5_15": {"start": [round(x, 2) for x in load_before], "end": load},
        "seconds": round(measured.seconds, 1), "device": device,
    }


def _summary(measured: Any, output: Path) -> str:
    p, d = measured.prefill_error, measured.decode_error

    def abc(values) -> str:
        return ", ".join(f"{v:.4g}" for v in values)

    return "\n".join([
        f"wrote {output} ({measured.seconds:.0f} s of timing)",
        f"  prefill_ms = ({abc(measured.prefill_abc)})   fit error mean {p.mean_rel:.1%}, max {p.max_rel:.1%}",
        f"  decode_ms  = ({abc(measured.decode_small_batch_abc)}) for B < {measured.large_batch_from}, "
        f"({abc(measured.decode_large_batch_abc)}) from it   fit error mean {d.mean_rel:.1%}, max {d.max_rel:.1%}",
        f"  KV capacity {measured.kv_capacity_tokens} tokens",
    ])
