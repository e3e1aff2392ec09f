"""C kernels of the CPU engine (`cpu_kernels.c`), built with the machine's C compiler on
first use.

- `paged_decode`: the decode step's attention over the paged cache; each query head
  reads its sequence's keys and values in place through the block table. The torch path
  it replaces gathers every sequence's padded context into new tensors each layer and
  runs small batched matmuls per KV head; at 32 sequences of ~80 tokens (SmolLM2's 9
  query and 3 KV heads of 64) the kernel took 0.45-0.6 ms a layer where that path took
  1.3-2.4 ms. Its vector path, reading the cache front to back, took 11.8 ms a decode
  step over the 30 layers at 32 sequences of ~80 tokens, where the scalar one per KV head
  took 35 ms (the cache read cold, as a step reads it after streaming the weights). Built for
  AVX-512 (head_dim a multiple of 16), in 16-float vectors: 17-22% less a layer than the
  AVX2 build at SmolLM2's heads (a Xeon, the two side by side). The blocks lie anywhere
  in the cache, so the kernel prefetches the next block's keys and a block's values while
  it scores the keys: over 30 layers' caches, 32 sequences of 40-80 tokens, a layer took
  0.455 ms where 0.558 without (1.36x [0.94-1.82] over 15 alternating rounds; 1.56x at
  200-400 tokens). The bfloat16 kernel runs the same vector loops, widening each key and
  value as it loads them: 0.284 ms where its scalar loops per KV head took 0.547 (1.78x
  [1.42-2.35]; 2.31x at 200-400 tokens), the same outputs bit for bit.
- `packed_linear` (with `pack_linear`): the linears of a decode step, x W^T for up to
  `PACKED_MAX_ROWS` rows from W packed in panels of 16 output features, read once front
  to back (`cpu_kernels.c`). Over SmolLM2's 30 layers and LM head read cold, as a decode
  step reads them, oneDNN's blocked layout took 1.3-1.6x as long from 2 to 64 rows and
  the (in, out) layout with MKL as long at one row, 1.3-3x as long from 2 rows on. Built
  for AVX-512, three rows or more go two panels at a time in 16-float vectors, the next
  pair of panels prefetched while the last block of rows runs: on a Xeon with AVX-512,
  the same linears read cold at 32 rows ran at 57 GMAC/s where the AVX2 build ran 27 and
  MKL 36, and a batch-32 decode step went from level with transformers to 1.74x.
- `packed_linear_bf16` (with `pack_linear_bf16`): the bfloat16 linears of a decode step,
  up to `PACKED_MAX_ROWS_BF16` rows, on AMX's tiles (where the CPU has them and Linux
  grants the process their state), W packed in AMX's pair layout, panels of 16 output
  features read once front to back, the next pair prefetched. Over SmolLM2's 30 layers
  read cold, one thread, 1.1-1.2x faster than oneDNN's blocked bfloat16 GEMMs (themselves
  on AMX) from 1 to 32 rows, level at 48, slower from 128; `llama_decode_bf16` then runs
  a bfloat16 decode step's layers in one call as `llama_decode` does.
- `rms_norm`: one call where torch's CPU `rms_norm` runs a dozen operators (17 us a call
  for one row of 576 in a loop, ~100 us inside a decode step).
- `prefill_attention`: causal attention over a prefill's own new tokens, unpadded,
  keys packed in transposed tiles once per sequence and KV head, a query's grouped heads
  scored together. At SmolLM2's heads, one thread, a layer took 19-24 ms at 4 prompts of
  512 tokens where torch's CPU flash SDPA took 37-39 ms, and 5.4-6.3 ms at 32 of 64
  where it took 6.8-8.0 ms (AMD EPYC, AVX2). Built for AVX-512 (head_dim a multiple of
  16), in 16-float vectors, two queries' heads a block: 13.3 ms at 512 x 4 where SDPA,
  itself AVX-512 there, took 24.9 ms and the AVX2 build 25.8 (a Xeon).
- `prefill_attention_bf16`: `prefill_attention` for bfloat16 on AMX's tiles (head_dim a
  multiple of 32 up to 128): keys and values packed in the pair layout once per sequence
  and KV head, each query head's blocks of 16 queries scored on the tiles, an exact
  softmax per query in float32 (its weights rounded to bfloat16 by AVX512-BF16), the
  weighted values summed on the tiles. At SmolLM2's heads, one thread, a layer took
  4.3-4.8 ms at 4 prompts of 512 tokens where torch's CPU flash SDPA took 7.8-8.0 ms in
  bfloat16, and 1.1-1.2 ms at 32 of 64 where it took 2.1-2.4 ms (a Xeon with AMX).
- `llama_decode`: a Llama decode step's layers in one call (tp 1, float32, every linear
  packed): the kernels above in the order the Python path calls them, so the hidden
  states are the same bit for bit, without the Python and operator dispatch of each
  layer (~0.3 ms a layer, a third of a one-sequence step beside its weights' stream).
- `swiglu` and `rotary`: a prefill's elementwise steps in one pass each, in place, in the
  build's widest vectors as `rms_norm` (torch runs silu_ then mul_, and for the rotation a
  cat, a mul_ and an addcmul_).
- `argmax_rows`: greedy sampling's argmax over the vocabulary. torch's CPU argmax runs a
  scalar loop: 4.2 ms for 32 rows of 49152 logits on one thread, where its max without
  indices took 0.3.

The shared library is built once into a cache folder (`DISTSERVE_KERNEL_DIR`, default
~/.cache/distserve/kernels), under a name that hashes the source and the flags, and
loaded with ctypes. Where no compiler is found or the build fails, each accessor
returns None, the log says why once, and the torch paths run. An image without a
compiler builds it ahead: `python -m distserve_engine.native` (DISTSERVE_KERNEL_DIR set
to a folder the image keeps).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_kernels.c")
# Reassociation lets the compiler vectorise the dot products' sums; no -ffast-math, which
# would also change how NaNs, infinities and denormals are handled.
BASE_FLAGS = ["-O3", "-shared", "-fPIC", "-fopenmp", "-fassociative-math", "-fno-signed-zeros",
              "-fno-trapping-math", "-ffp-contract=fast"]
BUILD_TIMEOUT_S = 120
PACKED_PANEL = 16  # output features per panel of a packed weight (cpu_kernels.c's PANEL)
# Rows up to which a linear reads its packed weight; more (a prefill) go to oneDNN, whose
# cache blocking keeps large products ahead (at 256 rows the two were level here).
PACKED_MAX_ROWS = 128
# The same for bfloat16 on AMX (`packed_linear_bf16`); more go to oneDNN's AMX GEMMs.
PACKED_MAX_ROWS_BF16 = 64

_lock = threading.Lock()
_loaded: dict[str, object] = {}  # "library" -> the ctypes library, or None once it failed
_is_off = False  # set within torch_paths_only()


def kernel_dir() -> Path:
    """Where built kernels are kept."""
    default = Path.home() / ".cache" / "distserve" / "kernels"
    return Path(os.environ.get("DISTSERVE_KERNEL_DIR") or default)


# x86-64 levels the kernels are built for, best first (torch's capability -> -march)
X86_LEVELS = {"AVX512": ["-march=x86-64-v4"], "AVX2": ["-march=x86-64-v3"], "DEFAULT": []}


def is_x86() -> bool:
    """Whether this machine is x86-64 (where the kernels' -march levels apply)."""
    return platform.machine().lower() in ("x86_64", "amd64")


def cpu_flags() -> list[str]:
    """-march for this CPU's vector unit as torch sees it: x86-64-v4 with AVX-512 (the
    16-float kernels), x86-64-v3 with AVX2."""
    if not is_x86():
        return []
    return list(X86_LEVELS.get(torch.backends.cpu.get_cpu_capability(), []))


def build(flags: list[str] | None = None) -> Path:
    """Compile cpu_kernels.c with these -march flags (this CPU's by default) into the
    cache, unless already there; the library's path. RuntimeError saying why on failure."""
    flags = cpu_flags() if flags is None else flags
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc or gcc on PATH, or CC)")
    source = SOURCE.read_bytes()
    key = hashlib.sha256(source + " ".join([*BASE_FLAGS, *flags]).encode()).hexdigest()[:16]
    target = kernel_dir() / f"cpu_kernels-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        built = Path(scratch) / target.name
        command = [compiler, *BASE_FLAGS, *flags, str(SOURCE), "-o", str(built), "-lm"]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise RuntimeError(f"{' '.join(command)}: {e}") from e
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} exited {done.returncode}: {done.stderr.strip()[-500:]}")
        os.replace(built, target)  # atomic: another process may be building the same key
    return target


def paged_decode():
    """The C decode-attention function, or None where the kernels cannot be built or
    loaded here."""
    return _kernel("paged_decode_f32")


def paged_decode_bf16():
    """The C decode attention for bfloat16 q and caches, or None (as `paged_decode`)."""
    return _kernel("paged_decode_bf16")


def pack_linear():
    """The C function that packs a float32 (out, in) weight for `packed_linear`, or None
    where the kernels cannot be built or loaded here or this CPU lacks AVX2 and FMA."""
    return _kernel("pack_linear_f32", needs_avx2=True)


def packed_linear():
    """The C product of up to PACKED_MAX_ROWS float32 rows with a packed weight, or None
    (as `pack_linear`)."""
    return _kernel("packed_linear_f32", needs_avx2=True)


def packed_linear_size(out_features: int, in_features: int) -> int:
    """Floats a packed weight holds (whole panels of 16 output features)."""
    return -(-out_features // PACKED_PANEL) * PACKED_PANEL * in_features


def pack_linear_bf16():
    """The C function that packs a bfloat16 (out, in) weight for `packed_linear_bf16`, or
    None where the kernels cannot be built or loaded here or the CPU lacks AMX."""
    return _kernel("pack_linear_bf16", needs_amx=True)


def packed_linear_bf16():
    """The C product of up to PACKED_MAX_ROWS_BF16 bfloat16 rows with a packed weight, on
    AMX's tiles, or None (as `pack_linear_bf16`)."""
    return _kernel("packed_linear_bf16", needs_amx=True)


def packed_linear_bf16_size(out_features: int, in_features: int) -> int:
    """bfloat16 elements a packed weight holds (whole panels of 16 output features, the
    input features padded to a multiple of 32)."""
    return -(-out_features // PACKED_PANEL) * PACKED_PANEL * -(-in_features // 32) * 32


def rms_norm():
    """The C RMSNorm function, or None where the kernels cannot be built or loaded here."""
    return _kernel("rms_norm_f32")


def rms_norm_bf16():
    """The C RMSNorm of bfloat16 rows (and weight), or None (as `rms_norm`)."""
    return _kernel("rms_norm_bf16")


def prefill_attention():
    """The C causal attention of a prefill over its own new tokens (head_dim a multiple
    of 8), or None (as `pack_linear`)."""
    return _kernel("prefill_attention_f32", needs_avx2=True)


def prefill_attention_bf16():
    """`prefill_attention` for bfloat16 q, k, v and out, its products on AMX's tiles
    (head_dim a multiple of 32 up to 128; it returns -2 for another), or None (as
    `pack_linear_bf16`)."""
    return _kernel("prefill_attention_bf16", needs_amx=True)


def llama_decode():
    """The C function that runs a Llama decode step's layers in one call, or None (as
    `pack_linear`)."""
    return _kernel("llama_decode_f32", needs_avx2=True)


def llama_decode_bf16():
    """`llama_decode` for bfloat16 weights and caches (its linears on AMX), or None (as
    `pack_linear_bf16`)."""
    return _kernel("llama_decode_bf16", needs_amx=True)


def swiglu():
    """The C in-place SwiGLU of a fused gate_up product, or None where the kernels cannot
    be built or loaded here."""
    return _kernel("swiglu_f32")


def rotary():
    """The C in-place rotary rotation of q's and k's heads, or None where the kernels
    cannot be built or loaded here."""
    return _kernel("rotary_f32")


def swiglu_bf16():
    """The C in-place SwiGLU of a bfloat16 gate_up product, or None (as `swiglu`)."""
    return _kernel("swiglu_bf16")


def rotary_bf16():
    """The C in-place rotary rotation of bfloat16 heads with a bfloat16 table, or None (as
    `rotary`)."""
    return _kernel("rotary_bf16")


def argmax_rows():
    """The C argmax of each row of a float32 matrix (torch.argmax's answer, ties and NaNs
    included), or None where the kernels cannot be built or loaded here."""
    return _kernel("argmax_rows_f32")


def for_dtype(accessor: str, dtype: torch.dtype):
    """The kernel an accessor of this module hands out for tensors of `dtype`: its own for
    float32, its `_bf16` twin's for bfloat16; None for another dtype, or where the
    accessor returns None."""
    if dtype == torch.float32:
        return globals()[accessor]()
    if dtype == torch.bfloat16:
        return globals()[f"{accessor}_bf16"]()
    return None


def _kernel(name: str, needs_avx2: bool = False, needs_amx: bool = False):
    """The library's function `name`; None where the kernels cannot be built or loaded
    here, with needs_avx2 where they were built without AVX2 and FMA, with needs_amx where
    the CPU lacks AMX's bfloat16 tiles (or Linux refuses this process their state)."""
    library = _library()
    if library is None or (needs_avx2 and not library.has_packed_linear):
        return None
    if needs_amx and not library.has_amx:
        return None
    return getattr(library, name)


@contextlib.contextmanager
def torch_paths_only():
    """Within this block the accessors return None, so the torch paths run (a benchmark
    that compares the two in one process)."""
    global _is_off
    _is_off = True
    try:
        yield
    finally:
        _is_off = False


def _library():
    """The kernels' library with argument types set, built and loaded at most once per
    process; None (said once in the log) where it cannot be."""
    if _is_off:
        return None
    with _lock:
        if "library" not in _loaded:
            _loaded["library"] = _load()
        return _loaded["library"]


def _load():
    if os.environ.get("DISTSERVE_NATIVE_KERNELS", "1") == "0":
        log.info("the CPU engine runs torch's paths: DISTSERVE_NATIVE_KERNELS=0")
        return None
    try:
        return load_library(build())
    except (RuntimeError, OSError) as e:
        log.warning("the CPU engine runs torch's paths for attention, RMSNorm, SwiGLU, "
                    "rotary and the decode linears, slower: its C kernels are not available "
                    "(%s)", e)
        return None


def load_library(path: Path):
    """The built library at path, its functions' argument types set (OSError when it
    cannot be loaded); `build(flags)` then this loads another CPU's build beside this one's."""
    library = ctypes.CDLL(str(path))
    pointer, size, real = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
    library.paged_decode_f32.argtypes = [pointer] * 5 + [size] * 6 + [real, pointer, ctypes.c_int]
    library.paged_decode_f32.restype = ctypes.c_int
    library.packed_linear_supported.argtypes = []
    library.packed_linear_supported.restype = ctypes.c_int
    library.has_packed_linear = bool(library.packed_linear_supported())  # asked once, not per call
    library.pack_linear_f32.argtypes = [pointer, size, size, pointer]
    library.pack_linear_f32.restype = ctypes.c_int
    library.packed_linear_f32.argtypes = [pointer, size, size, pointer, size, size, pointer,
                                          pointer, size, ctypes.c_int]
    library.packed_linear_f32.restype = ctypes.c_int
    library.rms_norm_f32.argtypes = [pointer, size, pointer, pointer, size, size, real]
    library.rms_norm_f32.restype = None
    library.prefill_attention_f32.argtypes = [pointer] * 4 + [size] * 6 + [real, pointer,
                                                                         ctypes.c_int]
    library.prefill_attention_f32.restype = ctypes.c_int
    library.llama_decode_f32.argtypes = (
        [pointer, size, size, size, pointer, real, pointer, pointer, size, pointer, pointer,
         size, pointer] + [size] * 5 + [pointer, pointer, real, ctypes.c_int])
    library.llama_decode_f32.restype = ctypes.c_int
    library.swiglu_f32.argtypes = [pointer, size, size, size, ctypes.c_int, ctypes.c_int]
    library.swiglu_f32.restype = None
    library.rotary_f32.argtypes = [pointer, size, size, size, size, pointer, pointer, ctypes.c_int]
    library.rotary_f32.restype = None
    library.paged_decode_bf16.argtypes = library.paged_decode_f32.argtypes
    library.paged_decode_bf16.restype = ctypes.c_int
    library.rms_norm_bf16.argtypes = library.rms_norm_f32.argtypes
    library.rms_norm_bf16.restype = None
    library.swiglu_bf16.argtypes = library.swiglu_f32.argtypes
    library.swiglu_bf16.restype = ctypes.c_int
    library.rotary_bf16.argtypes = library.rotary_f32.argtypes
    library.rotary_bf16.restype = None
    library.argmax_rows_f32.argtypes = [pointer, size, size, size, pointer]
    library.argmax_rows_f32.restype = None
    library.packed_linear_bf16_supported.argtypes = []
    library.packed_linear_bf16_supported.restype = ctypes.c_int
    library.has_amx = bool(library.packed_linear_bf16_supported())  # asked once, not per call
    library.pack_linear_bf16.argtypes = library.pack_linear_f32.argtypes
    library.pack_linear_bf16.restype = ctypes.c_int
    library.packed_linear_bf16.argtypes = library.packed_linear_f32.argtypes
    library.packed_linear_bf16.restype = ctypes.c_int
    library.prefill_attention_bf16.argtypes = library.prefill_attention_f32.argtypes
    library.prefill_attention_bf16.restype = ctypes.c_int
    library.llama_decode_bf16.argtypes = library.llama_decode_f32.argtypes
    library.llama_decode_bf16.restype = ctypes.c_int
    return library


def main() -> None:
    """Build the kernel for this CPU and, on x86-64, for the levels below it (AVX2, and
    generic: an image built on one machine and run on another, each machine loading the
    build of its own level), printing where each went."""
    own, levels = cpu_flags(), list(X86_LEVELS.values())
    for flags in levels[levels.index(own):] if is_x86() else [own]:
        print(f"{' '.join(flags) or 'generic'}: {build(flags)}")


if __name__ == "__main__":
    main()
