"""KV transfer from a prefill instance to a decode instance, by where the two are.

The decode instance pulls; the transport is chosen from the `KVHandle` alone, never by
the user: the same process -> in-process handover of the tensors; a /dev/shm shared with the
prefill process, proven by its arena's token file -> shared memory (the arena mapped
once by the decode side, which copies straight from it into its cache; HTTP carries only
the control calls); otherwise (another pod or host) -> TCP (the raw bytes over the
prefill instance's HTTP port).
# NOTE: a GPU-to-GPU path (NCCL / CUDA IPC) is not built: on CUDA the KV goes through
# host memory with the transports above.
"""

from distserve_engine.transfer.fetcher import KVFetcher

__all__ = ["KVFetcher"]
