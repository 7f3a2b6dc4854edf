# Every target bootstraps .venv when it is missing or older than pyproject.toml.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
PROTOS := $(addprefix proto/devplugin/api/,deviceplugin_v1beta1.proto podresources_v1.proto \
	dra_v1.proto dra_v1beta1.proto dra_health_v1alpha1.proto pluginregistration_v1.proto)

.PHONY: install test test-quick demo bench proto lint chart-schema image clean

# setup.py and the C source too: the editable install compiles the allocator's fold.
$(STAMP): pyproject.toml setup.py devplugin/policy/_foldc.c
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "devplugin needs Python >= 3.11")'
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

# The whole suite, slow simulations included (what CI runs), on two workers.
test: $(STAMP)
	$(BIN)/python -m pytest -q -n 2

# Everything but the tests marked slow: the edit-run loop.
test-quick: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 -m "not slow"

demo: $(STAMP)
	$(BIN)/devplugin demo

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
image:
	@docker info >/dev/null 2>&1 || { echo "make image: no Docker engine reachable (docker info failed)" >&2; exit 1; }
	docker build --build-arg VERSION=$(VERSION) -t devplugin:$(VERSION) .

# Every environment and cache the targets and the tests create.
clean:
	rm -rf $(VENV) .venv-helm .venv-helm.lock .pytest_cache .mypy_cache .ruff_cache .import_linter_cache
