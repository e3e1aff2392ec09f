"""What a latency profile depends on besides the model: the machine it was measured on.

A profile's timings hold only on a machine like the one that measured them (same CPU
model, core count, threads per rank, torch). This module describes this machine and the
one a profile file records in its `device` section, without importing torch (the
operator's image has none), so `distserve up` can tell whether a profile is this
machine's and say which machine it is otherwise.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
from dataclasses import dataclass
from pathlib import Path

NVIDIA_GPUS = Path("/proc/driver/nvidia/gpus")


@dataclass(frozen=True)
class Machine:
    """The hardware and software a profile's timings depend on."""

    device: str  # "cpu" or "cuda"
    cpu_model: str
    cpu_cores: int
    threads: int  # CPU threads per instance rank
    torch: str  # torch's version, e.g. "2.13.0+cpu"
    gpu_model: str | None = None

    @classmethod
    def here(cls, device: str, threads: int = 1) -> Machine:
        """This machine, running the engine on `device` with `threads` per rank."""
        gpu = gpu_model() if device.startswith("cuda") else None
        return cls(device.split(":")[0], cpu_model(), os.cpu_count() or 1, threads,
                   torch_version(), gpu)

    @classmethod
    def of_profile(cls, doc: dict) -> Machine | None:
        """The machine a profile file records (`device`), None if it records none."""
        device = doc.get("device")
        if not isinstance(device, dict) or "cpu_model" not in device:
            return None
        return cls(str(device.get("type", "cpu")).split(":")[0], str(device["cpu_model"]),
                   int(device.get("cpu_cores") or 0), int(device.get("threads") or 1),
                   str(device.get("torch", "unknown")), device.get("gpu_model"))

    def matches(self, other: Machine) -> bool:
        """Whether timings measured on `other` hold here (every field equal)."""
        return self == other

    def describe(self) -> str:
        """For a user: `1 thread of Intel(R) Xeon(R) Processor (2 cores), torch 2.13.0+cpu`."""
        if self.gpu_model:
            return f"{self.gpu_model} ({self.cpu_model}, {self.cpu_cores} cores), torch {self.torch}"
        threads = f"{self.threads} thread{'s' if self.threads != 1 else ''}"
        return f"{threads} of {self.cpu_model} ({self.cpu_cores} cores), torch {self.torch}"


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (else the platform's processor string)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def torch_version() -> str:
    """The installed torch's version, read without importing it ("none" if absent)."""
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return "none"


def gpu_model() -> str | None:
    """The first NVIDIA GPU's model name from the driver's /proc files, None if none."""
    try:
        for info in sorted(NVIDIA_GPUS.glob("*/information")):
            for line in info.read_text().splitlines():
                if line.startswith("Model:"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None
