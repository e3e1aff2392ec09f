"""Accelerators: the peak numbers the analytic latency model and the memory check use.

Figures are vendor datasheet peaks (dense fp16/bf16 tensor FLOP/s, HBM bandwidth) and
the memory that `nvidia-smi` reports; the latency model applies its own efficiency
factors. Link bandwidths are per GPU and per direction, which is what a ring all-reduce
or a point-to-point KV copy can use.
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 2**30
GBIT_BYTES = 1e9 / 8  # one gigabit per second in bytes per second


@dataclass(frozen=True)
class Accelerator:
    """One accelerator's peak capabilities."""

    name: str
    peak_flops: float  # dense fp16/bf16 tensor FLOP/s
    mem_bandwidth_bytes_per_s: float
    memory_bytes: int
    intra_node_link_bytes_per_s: float  # GPU-to-GPU inside a node, per direction
    inter_node_link_bytes_per_s: float = 25 * GBIT_BYTES  # the paper's 25 Gbps network
    has_nvlink: bool = True


BUILTIN_ACCELERATORS: tuple[Accelerator, ...] = (
    # A100 SXM: NVLink3 600 GB/s bidirectional per GPU -> 300 GB/s each way.
    Accelerator("A100-80GB", 312e12, 2.039e12, 80 * GIB, 300e9),
    # H100 SXM: NVLink4 900 GB/s bidirectional -> 450 GB/s each way; NDR 400 Gb/s NICs.
    Accelerator("H100-80GB", 989e12, 3.35e12, 80 * GIB, 450e9, 400 * GBIT_BYTES),
    # H200 SXM: H100 compute with 141 GB HBM3e (nvidia-smi shows about 140 GiB).
    Accelerator("H200-141GB", 989e12, 4.8e12, 140 * GIB, 450e9, 400 * GBIT_BYTES),
    # L40S: PCIe Gen4 x16 only (about 32 GB/s each way), no NVLink; 100 Gb/s Ethernet.
    Accelerator("L40S", 362e12, 864e9, 45 * GIB, 32e9, 100 * GBIT_BYTES, has_nvlink=False),
    # A laptop or CI runner: a few cores with AVX2, dual-channel DDR; "links" are
    # shared-memory copies between processes.
    Accelerator("CPU", 5e11, 20e9, 16 * GIB, 10e9, 10e9, has_nvlink=False),
)

_ALIASES: dict[str, str] = {
    "a100": "A100-80GB",
    "a100-80g": "A100-80GB",
    "a100-sxm4-80gb": "A100-80GB",
    "nvidia-a100-80gb": "A100-80GB",
    "h100": "H100-80GB",
    "h100-80g": "H100-80GB",
    "h100-sxm": "H100-80GB",
    "nvidia-h100-80gb-hbm3": "H100-80GB",
    "h200": "H200-141GB",
    "h200-141g": "H200-141GB",
    "nvidia-h200": "H200-141GB",
    "l40s": "L40S",
    "nvidia-l40s": "L40S",
    "cpu": "CPU",
}

_NAME_TO_ACCELERATOR: dict[str, Accelerator] = {a.name.lower(): a for a in BUILTIN_ACCELERATORS}
for _alias, _full in _ALIASES.items():
    _NAME_TO_ACCELERATOR[_alias] = _NAME_TO_ACCELERATOR[_full.lower()]


def known_accelerators() -> list[str]:
    """Names `get_accelerator` accepts."""
    return [a.name for a in BUILTIN_ACCELERATORS] + sorted(_ALIASES)


def get_accelerator(name: str | Accelerator) -> Accelerator:
    """A built-in accelerator by name or alias (any case, spaces or underscores as dashes).

    Raises ValueError naming the known accelerators.
    """
    if isinstance(name, Accelerator):
        return name
    key = str(name).strip().lower().replace("_", "-").replace(" ", "-")
    accelerator = _NAME_TO_ACCELERATOR.get(key)
    if accelerator is None:
        raise ValueError(
            f"unknown accelerator {name!r}: expected one of {', '.join(known_accelerators())}"
        )
    return accelerator
