# Every target bootstraps .venv when it is missing or older than pyproject.toml.
PYTHON ?= python3
# Some machines set PYTHONDONTWRITEBYTECODE: every test worker and every daemon
# a test starts would then compile grpc, the Kubernetes client and the suite
# from source (and pytest rewrite each test module's asserts) again, seconds of
# CPU each. The caches are ignored by git.
unexport PYTHONDONTWRITEBYTECODE
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
PROTOS := $(addprefix proto/devplugin/api/,deviceplugin_v1beta1.proto podresources_v1.proto \
	dra_v1.proto dra_v1beta1.proto dra_health_v1alpha1.proto pluginregistration_v1.proto)

.PHONY: install test test-slow test-quick test-cluster test-node test-prometheus upstream demo demo-node bench proto lint chart-schema image clean

# setup.py and the C source too: the editable install compiles the allocator's fold.
$(STAMP): pyproject.toml setup.py devplugin/policy/_foldc.c
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "devplugin needs Python >= 3.11")'
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

# The chart tests' Helm (helm-sdkpy in a Python 3.12 environment of its own),
# made before the tests run; where it cannot be, it says why and those skip.
HELM_STAMP := .venv-helm/.made
$(HELM_STAMP): scripts/helm-env.sh
	sh scripts/helm-env.sh .venv-helm
	touch $(HELM_STAMP)

# The suite but the slow simulations, on four workers (its tests mostly wait
# on daemons, so four fit two cores). The real-runtime tier (podman, runc)
# is in it and skips, saying why, where those are missing.
test: $(STAMP) $(HELM_STAMP)
	$(BIN)/python -m pytest -q -n 4 -m "not slow and not cluster and not node and not prometheus"

# The slow simulations (storms, kill loops, churn), CPU-bound: two workers.
test-slow: $(STAMP) $(HELM_STAMP)
	$(BIN)/python -m pytest -q -n 2 -m "slow and not cluster and not node and not prometheus"

# Everything but the real-runtime tier and the slow simulations: the edit-run loop.
test-quick: $(STAMP) $(HELM_STAMP)
	$(BIN)/python -m pytest -q -n 4 -m "not slow and not real_runtime and not cluster and not node and not prometheus"

# The real control planes the cluster tier runs (etcd, kube-apiserver,
# kube-controller-manager, kube-scheduler, kubectl), built from the Go
# modules pinned under upstream/ and cached by pin (~/.cache/devplugin-upstream).
# The node tier's containerd v2 (with its runc shim and ctr) is pinned there too.
UPSTREAM_MINORS ?= v1.35 v1.37
upstream:
	@for pin in $(UPSTREAM_MINORS) containerd prometheus-operator; do upstream/build.sh $$pin || exit $$?; done

# The real-cluster tier: the chart, the daemons, the extender and DRA
# judged by those control planes; it builds them first where Go is here.
test-cluster: $(STAMP) $(HELM_STAMP)
	@if command -v go >/dev/null 2>&1; then $(MAKE) --no-print-directory upstream; fi
	$(BIN)/python -m pytest -q -rP -p no:randomly -m cluster tests/real_cluster

# The real-node tier: a kubelet and containerd built from the pins in upstream/
# (root, util-linux, runc and the CNI plugins needed; it says why it skips).
test-node: $(STAMP) $(HELM_STAMP)
	@if command -v go >/dev/null 2>&1; then $(MAKE) --no-print-directory upstream; fi
	$(BIN)/python -m pytest -q -p no:randomly -m node tests/real_node

# The monitoring tier: a real Prometheus (Debian's prometheus package)
# scrapes a daemon and an extender and evaluates the chart's alert rules.
test-prometheus: $(STAMP) $(HELM_STAMP)
	$(BIN)/python -m pytest -q -p no:randomly -m prometheus tests/prometheus

demo: $(STAMP)
	$(BIN)/devplugin demo

# The daemon beside a real kubelet, containerd and control plane (root, Go):
# builds the newest pin's binaries and containerd once, then runs a pod.
demo-node: $(STAMP)
	upstream/build.sh v1.37 >/dev/null && upstream/build.sh containerd >/dev/null
	$(BIN)/devplugin demo --real-node $(if $(STAY),--stay)

bench: $(STAMP)
	$(BIN)/python -m bench

proto: $(STAMP)
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/python -m grpc_tools.protoc -Iproto \
		--python_out=. --mypy_out=. --grpc_python_out=. --mypy_grpc_out=. $(PROTOS)

chart-schema: $(STAMP)
	$(BIN)/python scripts/chart_schema.py

lint: $(STAMP)
	$(BIN)/ruff check devplugin tests bench scripts
	$(BIN)/ruff format --check devplugin tests bench scripts
	$(BIN)/python scripts/chart_schema.py --check
	$(BIN)/mypy
	$(BIN)/lint-imports --no-cache

VERSION ?= $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
# The image, with podman where it is installed, else Docker. IMAGE_BASE: a
# base other than python:3.11-slim (scripts/image-base.sh makes one).
BUILDER ?= $(shell command -v podman >/dev/null 2>&1 && echo podman || echo docker)
image:
	$(BUILDER) build --build-arg VERSION=$(VERSION) $(if $(IMAGE_BASE),--build-arg BASE=$(IMAGE_BASE)) \
		-t devplugin:$(VERSION) .

# Every environment and cache the targets and the tests create.
clean:
	rm -rf $(VENV) .venv-helm .pytest_cache .mypy_cache .ruff_cache .import_linter_cache .cache
