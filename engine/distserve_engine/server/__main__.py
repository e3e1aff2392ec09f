"""Entry point of every serving process: `python -m distserve_engine.server`.

    python -m distserve_engine.server --config serve.json --role prefill --instance prefill-0 \
        --port 8001 [--host 0.0.0.0] [--advertise-url http://prefill-0.svc:8001] [--cpu-cores 0]
    python -m distserve_engine.server --config serve.json --role decode --instance decode-0 --port 8002
    python -m distserve_engine.server --config serve.json --role router --port 8000 \
        --prefill-peers http://prefill-0.svc:8001 --decode-peers decode-0=http://decode-0.svc:8002
    python -m distserve_engine.server --config serve.json --role all --port 8000

Arguments:
  --config FILE        JSON serving settings (see `server/settings.py`): engine config,
                       Lm, decode batch, SLOs, and for `--role router` the peers.
  --role ROLE          prefill | decode | colocated: one instance's internal API;
                       router: the OpenAI API over instances at --*-peers;
                       all: router and the settings' `instances` in this one process.
  --instance NAME      this instance's name in metrics and KV handles (default ROLE-0).
  --stage S            the pipeline stage this process runs of its instance, where each
                       stage is its own pod (Kubernetes); see below.
  --host, --port       where to listen (default 127.0.0.1:8000).
  --advertise-url URL  how other processes reach this one (default http://HOST:PORT);
                       decode instances pull KV from a prefill instance at this URL.
  --prefill-peers, --decode-peers, --colocated-peers  comma-separated URL or NAME=URL
                       (router); they override the settings' `peers`. Without them
                       the router re-reads the settings file while it runs (a change of
                       peers adds and drains instances; see `server/peers.py`).
  --cpu-cores LIST     pin the process to these cores (e.g. 0 or 0,1) and size torch's
                       threads to them.
  --api-key KEYS       router: /v1 and /debug need `Authorization: Bearer KEY`, one of
                       these comma-separated keys (default: $DISTSERVE_API_KEY; unset: open).
                       Prefer the variable: a command line is visible to every local user.
  --shutdown-timeout-s S  after SIGTERM, how long in-flight requests may take to finish
                       (default 30); a pod's terminationGracePeriodSeconds must exceed it.
  --log-level LEVEL    uvicorn's log level (default warning).

Instances on several ranks (tp * pp > 1; see `instance/ranks.py` and `instance/workers.py`):
  Rank 0 runs the instance and its HTTP API; the other ranks replay its engine calls.
  The settings' `parallel` entry of the --instance name gives its tp and pp, however
  it is started.
  - Local (`distserve up`): this process is rank 0 and spawns the other ranks on this
    host, splitting --cpu-cores into one equal slice per rank; on CUDA rank r takes the
    r-th GPU this process sees (`distserve up` sets CUDA_VISIBLE_DEVICES to the plan's
    GPUs of the instance, in stage order); the rendezvous is a free port on 127.0.0.1.
  - Kubernetes, one pod per pipeline stage: --stage S, and MASTER_ADDR (stage 0's pod)
    and MASTER_PORT in the environment. The process is
    rank S * tp and spawns the stage's other tp ranks (GPU i of the pod each). Stage
    0 serves the instance; a later stage serves only `GET /health` and `GET /livez` and
    exits when rank 0 stops or its connection fails.
  - One process per rank: WORLD_SIZE, RANK, MASTER_ADDR, MASTER_PORT (rank 0 serves).
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys

import uvicorn

from distserve_engine.instance import ranks

ROLES = ("prefill", "decode", "colocated", "router", "all")
# Thread pools that size themselves from the machine, not from the affinity mask, unless
# told before the library is imported: OpenMP/MKL/OpenBLAS (torch), and the Rust pool of
# Hugging Face tokenizers.
API_KEY_ENV = "DISTSERVE_API_KEY"
THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "RAYON_NUM_THREADS")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line."""
    p = argparse.ArgumentParser(prog="python -m distserve_engine.server",
                                description="Run one DistServe serving process.")
    p.add_argument("--config", required=True, help="JSON serving settings file")
    p.add_argument("--role", required=True, choices=ROLES)
    p.add_argument("--instance", default=None, help="instance name (default ROLE-0)")
    p.add_argument("--stage", type=int, default=None,
                   help="this pod's pipeline stage of the instance (one pod per stage)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--advertise-url", default=None)
    for role in ("prefill", "decode", "colocated"):
        p.add_argument(f"--{role}-peers", default=None, help=f"{role} instance URLs (router)")
    p.add_argument("--cpu-cores", default=None, help="comma-separated core ids to pin to")
    p.add_argument("--api-key", default=os.environ.get(API_KEY_ENV),
                   help=f"router API keys, comma-separated (default ${API_KEY_ENV})")
    p.add_argument("--shutdown-timeout-s", type=float, default=30.0)
    p.add_argument("--log-level", default="warning")
    return p.parse_args(argv)


def pin_process(cores: list[int] | None) -> None:
    """Pin this process to `cores` and size every thread pool to them, before torch loads.

    # NOTE: OpenMP reads OMP_NUM_THREADS once, when torch is imported; setting threads
    # afterwards leaves a pool sized to the whole machine spinning on the other cores.
    """
    if not cores:
        return
    os.sched_setaffinity(0, set(cores))
    for name in THREAD_ENV:
        os.environ[name] = str(len(cores))
    os.environ["TOKENIZERS_PARALLELISM"] = "false"


def build_app(args: argparse.Namespace):
    """The FastAPI app this process serves."""
    all_cores = [int(c) for c in args.cpu_cores.split(",")] if args.cpu_cores else None
    name = args.instance or f"{args.role}-0"
    layout = ranks.layout_for(args.config, args.role, name, args.stage)
    cores = layout.split_cores(all_cores)[0]  # rank 0's share; other ranks get the rest
    pin_process(cores)
    from distserve_engine.instance import workers
    from distserve_engine.server import assembly, edge
    from distserve_engine.server.instance_app import build_instance_app
    from distserve_engine.server.settings import Peer, ServeSettings

    settings = ServeSettings.load(args.config)
    assembly.pin_cpu(cores)
    if args.role in assembly.ROLES:
        host = socket.gethostname() if args.host in ("0.0.0.0", "::") else args.host
        url = args.advertise_url or f"http://{host}:{args.port}"
        runner = workers.start_ranks(layout, settings.engine, all_cores)
        if not layout.is_driver:  # a later pipeline stage: replay rank 0's calls
            return _worker_app(runner)
        instance = assembly.build_instance(args.role, name, settings, runner=runner, url=url)
        metrics = assembly.build_metrics(settings, args.role, name)
        app = build_instance_app(instance, metrics)
        app.router.on_shutdown.append(instance.stop)
        if isinstance(runner, workers.DriverRunner):
            app.router.on_shutdown.append(runner.stop)
        return app
    api_keys = tuple(edge.api_keys_from(args.api_key))
    if args.role == "all":
        router, instances, runner = assembly.build_in_process(settings)
        return assembly.build_frontend_app(
            settings, router, runner.tokenizer, runner.max_model_len,
            on_shutdown=lambda: [i.stop() for i in instances], api_keys=api_keys)
    from distserve_engine.server.peers import PeerWatcher

    peers = dict(settings.peers)
    for role in ("prefill", "decode", "colocated"):
        value = getattr(args, f"{role}_peers")
        if value:
            peers[role] = [Peer.parse(v, role, i) for i, v in enumerate(value.split(",")) if v]
    tokenizer, max_model_len = assembly.load_tokenizer(settings)
    metrics = assembly.build_metrics(settings, "router", name)
    router = assembly.build_router(settings, assembly.http_clients(peers), metrics)
    is_fixed = peers != settings.peers  # peers from the command line: nothing to watch
    watcher = None if is_fixed else PeerWatcher(args.config, router, assembly.http_clients)
    return assembly.build_frontend_app(settings, router, tokenizer, max_model_len, watcher=watcher,
                                       api_keys=api_keys)


def _worker_app(runner):
    """A worker rank's process: replays rank 0's calls in a thread; serves /health, /livez."""
    import threading

    from fastapi import FastAPI

    from distserve_engine.instance import workers

    app = FastAPI(title="DistServe worker rank")

    def serve_then_exit() -> None:
        code = 1  # a failed collective (rank 0 gone): exit so the pod restarts
        try:
            workers.run_worker(runner)
            code = 0
        finally:
            os._exit(code)

    thread = threading.Thread(target=serve_then_exit, name="worker", daemon=True)

    @app.get("/health")
    def health() -> dict:
        return {"status": "ok", "rank": runner.parallel.rank}

    @app.get("/livez")
    def livez() -> dict:  # the process exits when the replay thread ends
        return {"live": True, "rank": runner.parallel.rank}

    thread.start()
    return app


def main(argv: list[str] | None = None) -> int:
    """Build the app and serve it until SIGINT / SIGTERM (uvicorn handles both)."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("distserve_engine").setLevel(logging.INFO)  # weights loading progress
    try:
        app = build_app(args)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                timeout_graceful_shutdown=args.shutdown_timeout_s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
