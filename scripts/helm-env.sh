#!/bin/sh
# The chart tests' Helm: helm-sdkpy (Helm's Go library, pinned) in its own
# Python 3.12 environment, .venv-helm, made by `make test` before any test
# runs, so no test installs anything. Where no Python 3.12 is found, or the
# install fails, .venv-helm/UNAVAILABLE says why and the Helm tests skip
# with that line.
set -u
env_dir=${1:-.venv-helm}
version=0.1.32
rm -rf "$env_dir"
mkdir -p "$env_dir"
python=""
# pyenv's own copy first: its shim may refuse to run a version not selected.
for candidate in "$HOME"/.pyenv/versions/3.12*/bin/python3.12 "$(command -v python3.12 || true)"; do
    [ -n "$candidate" ] && [ -x "$candidate" ] || continue
    if "$candidate" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
        python=$candidate
        break
    fi
done
if [ -z "$python" ]; then
    echo "helm-sdkpy needs Python 3.12, and no python3.12 was found" > "$env_dir/UNAVAILABLE"
    exit 0
fi
if ! log=$("$python" -m venv --clear "$env_dir" 2>&1 && \
        "$env_dir/bin/python" -m pip install -q "helm-sdkpy==$version" 2>&1); then
    printf 'cannot install helm-sdkpy %s: %s\n' "$version" "$(printf '%s' "$log" | tail -c 300)" \
        > "$env_dir/UNAVAILABLE"
    exit 0
fi
touch "$env_dir/.installed"
