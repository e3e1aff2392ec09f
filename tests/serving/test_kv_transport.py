"""The KV transport is chosen by proof of shared memory, never by host name.

Pods of one node each have their own /dev/shm and may share a host name (every worker
pod of a stage is called the same). A decode process that does not see the prefill's
/dev/shm must pull over TCP and decode the right tokens; one that does must use shared
memory; and a shared-memory file that is not there must raise, never read zeros.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch
from serving_helpers import make_settings, wait_until
from test_ranks import completions
from test_up import free_port_block

from distserve_engine.kv_cache import KVBlob
from distserve_engine.request import KVHandle
from distserve_engine.transfer import KVFetcher, shm
from distserve_engine.transfer.codec import blob_header, kv_views


def _private_shm_works() -> bool:
    """True when this machine lets a process have a /dev/shm of its own (mount namespace)."""
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "sh", "-c",
         "mount -t tmpfs -o size=1m tmpfs /dev/shm && test -z \"$(ls /dev/shm)\""],
        capture_output=True, timeout=30)
    return probe.returncode == 0


def _private_shm(argv: list[str]) -> list[str]:
    """`argv` run in its own mount namespace with an empty /dev/shm, as in another pod."""
    return ["unshare", "-m", "--propagation", "private", "sh", "-c",
            'mount -t tmpfs -o size=256m tmpfs /dev/shm && exec "$@"', "sh", *argv]


class Deployment:
    """A prefill, a decode and a router process on loopback, the decode one maybe apart."""

    def __init__(self, config: Path, port: int, is_decode_apart: bool) -> None:
        server = [sys.executable, "-m", "distserve_engine.server", "--config", str(config)]
        self.url = f"http://127.0.0.1:{port}"
        prefill_url, decode_url = f"http://127.0.0.1:{port + 1}", f"http://127.0.0.1:{port + 2}"
        decode = [*server, "--role", "decode", "--instance", "decode-0", "--port", str(port + 2)]
        self.argvs = [
            [*server, "--role", "prefill", "--instance", "prefill-0", "--port", str(port + 1)],
            _private_shm(decode) if is_decode_apart else decode,
            [*server, "--role", "router", "--port", str(port),
             "--prefill-peers", f"prefill-0={prefill_url}", "--decode-peers", f"decode-0={decode_url}"],
        ]
        self.health_urls = [prefill_url, decode_url, self.url]
        self.procs: list[subprocess.Popen] = []

    def __enter__(self) -> Deployment:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.procs = [subprocess.Popen(a, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                      for a in self.argvs]
        for url in self.health_urls:
            if not wait_until(lambda u=url: self._is_up(u), timeout_s=180):
                self.__exit__()
                errors = [p.stderr.read().decode()[-2000:] for p in self.procs if p.stderr]
                raise AssertionError(f"{url} did not come up: {errors}")
        return self

    def _is_up(self, url: str) -> bool:
        if any(p.poll() is not None for p in self.procs):
            raise AssertionError(f"a serving process exited: {[p.args for p in self.procs if p.poll() is not None]}")
        try:
            return httpx.get(f"{url}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def __exit__(self, *_) -> None:
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()

    def transfer_bytes_by_transport(self) -> dict[str, float]:
        """The router's `distserve_kv_transfer_bytes_total`, by transport label."""
        by_transport: dict[str, float] = {}
        for line in httpx.get(f"{self.url}/metrics", timeout=10).text.splitlines():
            if line.startswith("distserve_kv_transfer_bytes_total{"):
                transport = line.split('transport="')[1].split('"')[0]
                by_transport[transport] = by_transport.get(transport, 0.0) + float(line.rsplit(" ", 1)[1])
        return by_transport


@pytest.mark.slow
@pytest.mark.parametrize("is_decode_apart", [False, True], ids=["shared-shm", "own-shm"])
def test_decode_pulls_by_what_it_can_see_and_decodes_right(tiny_llama, deployment, tmp_path,
                                                           is_decode_apart):
    if is_decode_apart and not _private_shm_works():
        pytest.skip("this machine gives no process a /dev/shm of its own (unshare -m, mount tmpfs)")
    reference_url, _ = deployment
    expected = completions(reference_url)
    config = tmp_path / "serve.json"
    config.write_text(json.dumps(make_settings(tiny_llama).to_dict()))
    with Deployment(config, free_port_block(3), is_decode_apart) as running:
        assert completions(running.url) == expected
        by_transport = running.transfer_bytes_by_transport()
    # Same host name either way: only the arena's token tells the two apart.
    assert set(by_transport) == ({"tcp"} if is_decode_apart else {"shm"})
    assert all(nbytes > 0 for nbytes in by_transport.values())


def _blob(num_tokens: int = 3) -> KVBlob:
    k = torch.arange(2 * num_tokens * 2 * 4, dtype=torch.float32).view(2, num_tokens, 2, 4)
    return KVBlob(k=k, v=-k, num_tokens=num_tokens)


needs_shm = pytest.mark.skipif(not shm.is_available(), reason="no /dev/shm on this machine")


@needs_shm
def test_prefill_token_is_seen_only_where_it_was_written():
    token = shm.make_token()
    fetcher = KVFetcher()
    try:
        assert shm.sees_token(token.name)
        handle = KVHandle("r1", "prefill-far", "http://127.0.0.1:1", shm_token=token.name)
        assert fetcher.transport_for(handle) == "shm"
        # A handle from a prefill whose /dev/shm this process does not see.
        elsewhere = KVHandle("r1", "prefill-far", "http://127.0.0.1:1",
                             shm_token=f"{shm.TOKEN_PREFIX}{'0' * 32}")
        assert fetcher.transport_for(elsewhere) == "tcp"
        assert fetcher.transport_for(KVHandle("r1", "prefill-far", "http://127.0.0.1:1")) == "tcp"
        for bad in ("../../etc/passwd", f"{shm.PREFIX}arena-1-x", f"{shm.TOKEN_PREFIX}x/../y"):
            assert not shm.sees_token(bad)
    finally:
        token.unlink()
        fetcher.close()
    assert not shm.sees_token(token.name)


@needs_shm
def test_arena_range_round_trip_and_release():
    arena = shm.Arena(3 * shm.ALIGN_BYTES)
    writer = shm.ArenaWriter()
    try:
        blob = _blob()
        where = arena.reserve("r1", blob.nbytes)
        k, v = kv_views(writer.range(where)[: blob.nbytes], list(blob.k.shape), blob.k.dtype)
        k.copy_(blob.k)  # what the prefill's export does
        v.copy_(blob.v)
        seen = arena.view("r1", blob_header(blob))
        torch.testing.assert_close(seen.k, blob.k)
        torch.testing.assert_close(seen.v, blob.v)
        assert arena.reserve("r2", 2 * shm.ALIGN_BYTES) is not None
        assert arena.reserve("r3", shm.ALIGN_BYTES) is None  # full: the pull goes over TCP
        assert arena.release("r1") and not arena.release("r1")
        assert arena.reserve("r3", shm.ALIGN_BYTES)["offset"] == 0  # the freed range again
    finally:
        arena.close()


@needs_shm
def test_missing_or_short_arena_raises_and_creates_nothing():
    writer = shm.ArenaWriter()
    ghost = {"path": str(shm.SHM_DIR / f"{shm.PREFIX}arena-0-missing"), "arena_bytes": 8192,
             "offset": 0, "nbytes": 4096}
    with pytest.raises(shm.ArenaError, match="do not share /dev/shm"):
        writer.range(ghost)
    assert not Path(ghost["path"]).exists()
    short = shm.SHM_DIR / f"{shm.PREFIX}short-test-{os.getpid()}"
    short.write_bytes(b"\0" * 16)
    try:
        with pytest.raises(shm.ArenaError, match="holds 16 bytes"):
            writer.range({**ghost, "path": str(short)})
    finally:
        short.unlink()
    with pytest.raises(shm.ArenaError, match="outside"):
        writer.range({**ghost, "path": "/etc/passwd"})
    with pytest.raises(shm.ArenaError, match="outside the 8192-byte arena"):
        writer.range({**ghost, "offset": 8192})
