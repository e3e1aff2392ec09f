"""Kubernetes: pure builders (plan -> objects) and the kopf handlers that apply them.

Modules: `naming` (names, labels, owner references), `nodes` (cluster shape from the
Node objects), `workers` and `router` (the builders), `status` and `health` (what the
status says), `client` (the API), `planning`, `applying` and `reconciling` (the
steps), `handlers` (kopf).

## The contract with the engine image (`distserve_engine.server`)

Every engine container runs `python -m distserve_engine.server` with:

| role | arguments |
| --- | --- |
| prefill, decode | `--role {prefill,decode} --instance N --stage S --config /etc/distserve/engine.json --host 0.0.0.0 --port P` |
| router | `--role router --config /etc/distserve/router/router.json --host 0.0.0.0 --port P` |

- `engine.json` (ConfigMap `<name>-<revision>-engine`): `{"deployment", "namespace",
  "revision", "plan": Plan.to_dict(), "model": spec.model, "engine": spec.engine,
  "instances": [endpoint, ...]}` (camelCase keys inside `model` and `engine`).
- `router.json` (ConfigMap `<name>-router`): `{"deployment", "model", "port",
  "instances": [endpoint, ...]}`; the operator rewrites it during a rollout and the
  router must re-read it when the mounted file changes (kubelet updates it within about
  a minute). It must send no new request to an endpoint with `"draining": true` and
  let that endpoint's in-flight requests finish.
- An endpoint: `{"role": "prefill"|"decode", "instance": N, "revision": id,
  "url": "http://s0.<name>-<revision>-p0.<namespace>.svc:P", "stages": pp,
  "draining": bool}`; the URL is the instance's stage-0 pod.
- The pods of one instance share a headless Service `<name>-<revision>-{p,d}N`; the
  pod of stage S has hostname `sS` in it, so stage S of an instance is
  `sS.<service>.<namespace>.svc` (NCCL rendezvous for pp > 1 and tp across pods).
- Environment: `DISTSERVE_DEPLOYMENT`, `DISTSERVE_REVISION` (workers only),
  `DISTSERVE_DEVICE` (auto|cuda|cpu), `POD_NAME`, `POD_NAMESPACE`, `NODE_NAME`, plus
  `spec.engine.env`. GPUs come as `nvidia.com/gpu: tp` (none when the accelerator is
  the CPU); `/dev/shm` is a memory-backed volume.
- Readiness: `GET /health` on port P must answer 200 once the model is loaded. A pod
  gets SIGTERM when it is removed, after it has been draining for the drain period
  (`DISTSERVE_DRAIN_SECONDS`, default 60) and has `terminationGracePeriodSeconds` 120.
"""
