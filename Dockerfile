# syntax=docker/dockerfile:1
# devplugin image: build the wheels and the environment in one stage, copy the
# environment into a clean one.
#
# BASE is any Debian-based image with Python 3.11 or newer and its venv
# module (python:3.11-slim by default). Where that cannot be pulled, CI
# makes one from Debian's packages (scripts/image-base.sh) and passes it.

ARG PYTHON=3.11
ARG BASE=python:${PYTHON}-slim

FROM ${BASE} AS build
# A C compiler for the allocator's compiled fold (this stage only), and
# Python's headers where the base's Python comes without them (Debian's).
RUN headers="$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["include"])')" \
    && dev="$([ -f "$headers/Python.h" ] || echo python3-dev)" \
    && apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev $dev \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY devplugin ./devplugin
# Our wheel and every dependency's; the build fails rather than produce a
# wheel without the compiled fold. Then the environment the image runs,
# installed from those wheels only, with its installer removed.
RUN python3 -m venv /opt/devplugin \
    && DEVPLUGIN_REQUIRE_NATIVE=1 /opt/devplugin/bin/pip wheel --no-cache-dir --wheel-dir /wheels . \
    && /opt/devplugin/bin/pip install --no-cache-dir --no-index --find-links=/wheels devplugin \
    && /opt/devplugin/bin/pip uninstall -y pip setuptools wheel

FROM ${BASE}
ARG VERSION=0.1.0
LABEL org.opencontainers.image.title="devplugin" \
      org.opencontainers.image.description="Kubelet device plugin for GPUs and RDMA HCAs with topology-aware joint allocation" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.source="https://github.com/devplugin/devplugin"
COPY --from=build /opt/devplugin /opt/devplugin
# Nothing in the final image can build or fetch code: the base's own pip
# goes too, where it has one.
RUN if python3 -m pip --version >/dev/null 2>&1; then \
        python3 -m pip uninstall -y pip setuptools wheel; \
    fi
ENV PATH=/opt/devplugin/bin:${PATH} PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
ENTRYPOINT ["devplugin", "run"]
