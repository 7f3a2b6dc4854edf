#!/usr/bin/env bash
# Builds one pinned set of upstream programs from the Go modules its folder
# pins, into a folder outside the checkout keyed by the pin's hash, so a
# machine builds each pin once and a fresh clone on the same machine reuses it
# (and Go's build cache). The programs are the go.mod's `tool` lines.
#   upstream/build.sh v1.35        a Kubernetes release (upstream/k8s-v1.35):
#                                  etcd, kube-apiserver, kube-controller-manager,
#                                  kube-scheduler, kubectl, kubelet
#   upstream/build.sh containerd   containerd v2, its runc shim, ctr
#   upstream/build.sh prometheus-operator
#                                  no program: the operator's CRDs (ServiceMonitor,
#                                  PrometheusRule) from its module, for the cluster tier
# It prints the folder holding the binaries (the CRDs).
# DEVPLUGIN_UPSTREAM_CACHE moves the cache (default ~/.cache/devplugin-upstream).
set -euo pipefail
name="$1"
here="$(cd "$(dirname "$0")" && pwd)"
case "$name" in
    v1.*) mod="$here/k8s-$name" main=k8s.io/kubernetes ;;
    containerd) mod="$here/containerd" main=github.com/containerd/containerd/v2 ;;
    prometheus-operator)
        mod="$here/prometheus-operator" main=github.com/prometheus-operator/prometheus-operator ;;
    *) echo "upstream: no pin named $name" >&2; exit 2 ;;
esac
[ -f "$mod/go.mod" ] || { echo "upstream: no pin for $name ($mod/go.mod)" >&2; exit 2; }
command -v go >/dev/null 2>&1 || { echo "upstream: go is not installed" >&2; exit 3; }
version="$(cd "$mod" && go list -m -f "{{.Version}}" "$main")"
key="$(cat "$mod/go.mod" "$mod/go.sum" "$0" $(ls "$mod"/*/main.go 2>/dev/null) | sha256sum | cut -c1-16)"
cache="${DEVPLUGIN_UPSTREAM_CACHE:-$HOME/.cache/devplugin-upstream}"
prefix="k8s"
[ "$name" = containerd ] && prefix="containerd"
[ "$name" = prometheus-operator ] && prefix="prometheus-operator"
out="$cache/$prefix-$version-$key"
if [ -f "$out/.built" ]; then
    echo "$out/bin"
    exit 0
fi
if [ "$prefix" = prometheus-operator ]; then
    # The module as go.sum pins it; its CRDs as the operator's release ships them.
    dir="$(cd "$mod" && go mod download -json "$main" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')"
    rm -rf "$out.partial"
    mkdir -p "$out.partial/bin"
    for kind in servicemonitors prometheusrules; do
        cp "$dir/example/prometheus-operator-crd/monitoring.coreos.com_$kind.yaml" "$out.partial/bin/"
    done
    touch "$out.partial/.built"
    rm -rf "$out"
    mv "$out.partial" "$out"
    echo "$out/bin"
    exit 0
fi
# The programs: the go.mod's tool block, and the folders with a main.go of
# our own (etcd, whose program its server module holds as etcdmain).
packages="$(sed -n '/^tool (/,/^)/p' "$mod/go.mod" | sed '1d;$d' | tr -d '\t')"
for main_go in "$mod"/*/main.go; do
    [ -f "$main_go" ] && packages="$packages ./$(basename "$(dirname "$main_go")")"
done
flags="-s -w"
tags=""
if [ "$prefix" = k8s ]; then
    major="${version#v}"; major="${major%%.*}"
    minornum="$(echo "$version" | cut -d. -f2)"
    # The version stamps upstream's release build sets (hack/lib/version.sh):
    # the API server derives its binary and emulation versions from them.
    for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
        flags="$flags -X $pkg.gitVersion=$version -X $pkg.gitMajor=$major -X $pkg.gitMinor=$minornum"
        flags="$flags -X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z"
    done
else
    # containerd's release build: its version stamp, and without the
    # snapshotters that need cgo (the tier uses overlayfs or native).
    flags="$flags -X github.com/containerd/containerd/v2/version.Version=$version"
    tags="no_btrfs no_devmapper no_zfs"
fi
rm -rf "$out.partial"
mkdir -p "$out.partial/bin"
started=$SECONDS
cd "$mod"
echo "upstream: building $name $version into $out" >&2
# shellcheck disable=SC2086  # the package list is words
CGO_ENABLED=0 go build -trimpath -tags "$tags" -ldflags "$flags" -o "$out.partial/bin/" $packages
echo "upstream: built $name $version in $((SECONDS - started)) s" >&2
touch "$out.partial/.built"
rm -rf "$out"
mv "$out.partial" "$out"
echo "$out/bin"
