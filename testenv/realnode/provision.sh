#!/usr/bin/env bash
# Real nodes (testenv/realnode): containerd, runc and the CNI plugins from
# Debian, and a kubelet built from the same Debian Kubernetes 1.20 source as
# the control plane (its .orig.tar.gz, downloaded by testenv/provision.sh, is
# reused). Cached in $SPOTGUARD_CACHE/testenv/bin/kubelet; a second run takes
# a second. Run by testenv/provision.sh (`make setup`), or on its own.
set -euo pipefail

CACHE=${SPOTGUARD_CACHE:-$HOME/.cache/spotguard}
BIN=$CACHE/testenv/bin
mkdir -p "$BIN"

# containerd 1.6 and runc 1.1; busybox (static) is the test image's userland; gcc builds
# the pause process of the pod sandboxes; patch applies the kubelet's patch.
RN_PKGS=(containerd runc containernetworking-plugins busybox-static gcc libc6-dev iproute2 util-linux patch)
rn_missing=()
for p in "${RN_PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || rn_missing+=("$p")
done
if [ ${#rn_missing[@]} -gt 0 ]; then
  printf '\n==> apt (real nodes): installing %s\n' "${rn_missing[*]}"
  [ "$(id -u)" = 0 ] || { echo "provision: installing Debian packages needs root (missing: ${rn_missing[*]})" >&2; exit 1; }
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq "${rn_missing[@]}" >/dev/null
fi

# The kubelet carries one patch (kubelet-final-status.patch): kubelet 1.20 can remove a deleted
# pod's exited containers before it records their terminated states, so their exit codes and
# termination messages never reach the apiserver; 1.22+ kubelets publish them first. The patch
# records them before the removal, as current kubelets do. A changed patch rebuilds the kubelet.
PATCH=$(dirname "$(readlink -f "$0")")/kubelet-final-status.patch
want_patch=$(sha256sum "$PATCH" | cut -c1-16)
if [ ! -x "$BIN/kubelet" ] || [ "$(cat "$BIN/kubelet.patch" 2>/dev/null)" != "$want_patch" ]; then
  printf '\n==> kubernetes: building kubelet for real nodes (about 5 min)\n'
  build=$CACHE/testenv/build
  mkdir -p "$build"
  cd "$build"
  ls kubernetes_*.orig.tar.gz >/dev/null 2>&1 || apt-get source --download-only kubernetes >/dev/null
  orig=$(ls kubernetes_*.orig.tar.gz | head -1)
  # A directory of its own: the control plane's build uses (and removes) src.
  rm -rf kubelet-src && mkdir kubelet-src
  tar -xzf "$orig" -C kubelet-src --strip-components=1
  cd kubelet-src
  patch -s -p1 <"$PATCH"
  export GOPATH=$PWD/.go CGO_ENABLED=0 GOFLAGS=-mod=vendor
  mkdir -p .go/src/k8s.io
  ln -sfn ../../.. .go/src/k8s.io/kubernetes
  nice -n 10 make WHAT=cmd/kubelet >build.log 2>&1 \
    || { tail -40 build.log >&2; echo "provision: kubelet build failed (log: $PWD/build.log)" >&2; exit 1; }
  install -m 0755 _output/local/bin/linux/amd64/kubelet "$BIN/kubelet"
  echo "$want_patch" >"$BIN/kubelet.patch"
  cd "$build" && rm -rf "$build/kubelet-src"
fi
