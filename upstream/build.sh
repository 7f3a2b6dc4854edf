#!/usr/bin/env bash
# Builds the control plane of one pinned Kubernetes release (etcd,
# kube-apiserver, kube-controller-manager, kube-scheduler, kubectl) from the
# Go modules upstream/k8s-<minor>/go.mod pins, into a folder outside the
# checkout keyed by the pin's hash, so a machine builds each pin once and a
# fresh clone on the same machine reuses it (and Go's build cache).
#   upstream/build.sh v1.35        prints the folder holding the binaries
# DEVPLUGIN_UPSTREAM_CACHE moves the cache (default ~/.cache/devplugin-upstream).
set -euo pipefail
minor="$1"
here="$(cd "$(dirname "$0")" && pwd)"
mod="$here/k8s-$minor"
[ -f "$mod/go.mod" ] || { echo "upstream: no pin for $minor ($mod/go.mod)" >&2; exit 2; }
command -v go >/dev/null 2>&1 || { echo "upstream: go is not installed" >&2; exit 3; }
version="$(cd "$mod" && go list -m -f "{{.Version}}" k8s.io/kubernetes)"
key="$(cat "$mod/go.mod" "$mod/go.sum" "$mod/etcd/main.go" "$0" | sha256sum | cut -c1-16)"
cache="${DEVPLUGIN_UPSTREAM_CACHE:-$HOME/.cache/devplugin-upstream}"
out="$cache/k8s-$version-$key"
if [ -f "$out/.built" ]; then
    echo "$out/bin"
    exit 0
fi
major="${version#v}"; major="${major%%.*}"
minornum="$(echo "$version" | cut -d. -f2)"
# The version stamps upstream's release build sets (hack/lib/version.sh):
# the API server derives its binary and emulation versions from them.
stamp=""
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    stamp="$stamp -X $pkg.gitVersion=$version -X $pkg.gitMajor=$major -X $pkg.gitMinor=$minornum"
    stamp="$stamp -X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z"
done
rm -rf "$out.partial"
mkdir -p "$out.partial/bin"
started=$SECONDS
cd "$mod"
echo "upstream: building Kubernetes $version and its etcd into $out" >&2
CGO_ENABLED=0 go build -trimpath -ldflags "-s -w$stamp" -o "$out.partial/bin/" \
    k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager \
    k8s.io/kubernetes/cmd/kube-scheduler k8s.io/kubernetes/cmd/kubectl ./etcd
echo "upstream: built $version in $((SECONDS - started)) s" >&2
touch "$out.partial/.built"
rm -rf "$out"
mv "$out.partial" "$out"
echo "$out/bin"
