#!/usr/bin/env bash
# End to end on kind: cluster, images, chart, a DistServeDeployment, an OpenAI request.
#
#   e2e/run.sh            # KEEP_CLUSTER=1 keeps the cluster afterwards
#
# Needs docker (with a running engine), kind and kubectl. The chart is installed with
# the helm CLI when present, else rendered with the Helm library (helm-python-sdk) and
# applied with kubectl.
set -euo pipefail
cd "$(dirname "$0")/.."

CLUSTER=${CLUSTER:-distserve-e2e}
NAMESPACE=distserve-system
TIMEOUT=${TIMEOUT:-900s}
log() { printf '\n== %s\n' "$*" >&2; }

for tool in docker kind kubectl; do
  command -v "$tool" >/dev/null || { echo "e2e: $tool not found" >&2; exit 2; }
done
docker info >/dev/null 2>&1 || { echo "e2e: docker engine not reachable" >&2; exit 2; }

cleanup() {
  if [ "${KEEP_CLUSTER:-0}" != "1" ]; then kind delete cluster --name "$CLUSTER" >/dev/null 2>&1 || true; fi
  [ -n "${PF_PID:-}" ] && kill "$PF_PID" 2>/dev/null || true
}
trap cleanup EXIT

log "kind cluster $CLUSTER"
kind get clusters | grep -qx "$CLUSTER" || kind create cluster --name "$CLUSTER" --wait 120s

log "images"
docker build -f operator/Dockerfile -t distserve/operator:e2e .
docker build -f engine/Dockerfile -t distserve/engine:e2e .
kind load docker-image --name "$CLUSTER" distserve/operator:e2e distserve/engine:e2e

log "chart"
kubectl create namespace "$NAMESPACE" --dry-run=client -o yaml | kubectl apply -f -
if command -v helm >/dev/null; then
  helm upgrade --install distserve charts/distserve -n "$NAMESPACE" --wait \
    --set image.repository=distserve/operator --set image.tag=e2e --set image.pullPolicy=Never \
    --set operator.drainSeconds=5 --set operator.monitorIntervalSeconds=3
else
  kubectl apply --server-side -f charts/distserve/crds/
  python - "$NAMESPACE" <<'PY' | kubectl apply -n "$NAMESPACE" -f -
import sys
import helm_python as helm
values = {"image": {"repository": "distserve/operator", "tag": "e2e", "pullPolicy": "Never"},
          "operator": {"drainSeconds": 5, "monitorIntervalSeconds": 3}}
with helm.Chart.load("charts/distserve") as chart:
    rendered = chart.render(values, name="distserve", namespace=sys.argv[1], is_install=True)
print("\n---\n".join(text for path, text in sorted(rendered.items()) if path.endswith(".yaml")))
PY
  kubectl -n "$NAMESPACE" rollout status deploy/distserve-operator --timeout=300s
fi

log "DistServeDeployment"
kubectl apply -f e2e/distserve-cpu.yaml
kubectl wait --for=jsonpath='{.status.planId}' distservedeployment/smollm2 --timeout=300s || true
kubectl get distservedeployment smollm2 -o wide
if ! kubectl wait --for=condition=Ready distservedeployment/smollm2 --timeout="$TIMEOUT"; then
  kubectl describe distservedeployment smollm2; kubectl get pods -o wide
  kubectl -n "$NAMESPACE" logs deploy/distserve-operator --tail=100
  exit 1
fi

log "OpenAI request through the Service"
kubectl port-forward svc/smollm2 18000:8000 >/dev/null 2>&1 & PF_PID=$!
for _ in $(seq 30); do curl -fs localhost:18000/health >/dev/null && break; sleep 1; done
PROMPT="The capital of France is"
reply=$(curl -fsS localhost:18000/v1/completions -H 'Content-Type: application/json' \
  -d "{\"model\": \"HuggingFaceTB/SmolLM2-135M-Instruct\", \"prompt\": \"$PROMPT\", \"max_tokens\": 16, \"temperature\": 0, \"ignore_eos\": true}")
echo "$reply"

log "greedy text equal to a single engine's (the KV crossed pods: a wrong transport decodes garbage)"
decode_pod=$(kubectl get pods -l distserve.io/deployment=smollm2,distserve.io/role=decode -o jsonpath='{.items[0].metadata.name}')
expected=$(kubectl exec -i "$decode_pod" -- python - /etc/distserve/serve.json "$PROMPT" 16 < e2e/reference.py)
echo "single engine: $expected"
echo "$reply" | EXPECTED="$expected" python -c '
import json, os, sys
text, expected = json.load(sys.stdin)["choices"][0]["text"], os.environ["EXPECTED"]
assert text == expected, f"deployment {text!r} != single engine {expected!r}"'
curl -fsS localhost:18000/metrics | grep -E '^distserve_kv_transfer_bytes_total' \
  | grep -q 'transport="tcp"' || { echo "e2e: the KV did not cross pods over TCP" >&2; exit 1; }
log "e2e passed"
