#!/usr/bin/env bash
# Writes upstream/k8s-<minor>/go.mod for one k8s.io/kubernetes release: the
# module requires k8s.io/kubernetes at that version and replaces each of its
# staging modules (which its own go.mod names v0.0.0 and replaces with local
# folders) with the staging module published for the same release. Run it
# when moving a pin; the result (go.mod, go.sum) is committed.
#   upstream/pin.sh v1.35.4
set -euo pipefail
version="$1"                                   # v1.35.4
minor="$(echo "$version" | cut -d. -f1-2)"      # v1.35
staging="v0.${version#v1.}"                     # v0.35.4
here="$(cd "$(dirname "$0")" && pwd)"
dir="$here/k8s-$minor"
mkdir -p "$dir"
modfile="$(go mod download -json "k8s.io/kubernetes@$version" | sed -n 's/.*"GoMod": "\(.*\)".*/\1/p')"
goline="$(grep -m1 '^go ' "$modfile")"
{
    echo "// Built by upstream/build.sh; written by upstream/pin.sh $version."
    echo "module devplugin.test/upstream/k8s-$minor"
    echo
    echo "$goline"
    echo
    echo "require k8s.io/kubernetes $version"
    echo
    echo "replace ("
    grep -E '^\s*k8s\.io/[a-z0-9-]+ => \./staging/' "$modfile" |
        awk -v s="$staging" '{print "\t" $1 " => " $1 " " s}'
    echo ")"
} >"$dir/go.mod"
mkdir -p "$dir/etcd"
# etcd's program lives in its root module; its server module (which
# kube-apiserver's module already pins) holds the whole of it as etcdmain.
cat >"$dir/etcd/main.go" <<'GO'
// Command etcd runs etcd's own entry point at the version the pinned
// Kubernetes release requires.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() { etcdmain.Main(os.Args) }
GO
cd "$dir"
for tool in $(cat "$here/tools.txt"); do
    go get -tool "$tool@$version"
done
go mod tidy
