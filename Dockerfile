# syntax=docker/dockerfile:1
# devplugin image: build the wheels in one stage, install them in a slim one.

ARG PYTHON=3.11

FROM python:${PYTHON}-slim AS build
# A C compiler for the allocator's compiled fold (this stage only).
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY devplugin ./devplugin
# Our wheel and every dependency's, so the final stage installs offline; the
# build fails rather than produce a wheel without the compiled fold.
RUN DEVPLUGIN_REQUIRE_NATIVE=1 python -m pip wheel --no-cache-dir --wheel-dir /wheels .

FROM python:${PYTHON}-slim
ARG VERSION=0.1.0
LABEL org.opencontainers.image.title="devplugin" \
      org.opencontainers.image.description="Kubelet device plugin for GPUs and RDMA HCAs with topology-aware joint allocation" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.source="https://github.com/devplugin/devplugin"
COPY --from=build /wheels /wheels
# Install from the wheels only, then drop the installer: nothing in the
# final image can build or fetch code.
RUN python -m pip install --no-cache-dir --no-index --find-links=/wheels devplugin \
    && rm -rf /wheels \
    && python -m pip uninstall -y pip setuptools wheel
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
ENTRYPOINT ["devplugin", "run"]
