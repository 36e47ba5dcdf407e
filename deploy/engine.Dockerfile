# syntax=docker/dockerfile:1
# Engine image: CUDA torch, the engine and model code, Triton kernels, optionally flash-attn.
# Build from the repository root:
#   docker build -f deploy/engine.Dockerfile -t nanoserve-engine:0.1.0 .
#   docker build -f deploy/engine.Dockerfile --build-arg FLASH_ATTN=1 -t ... .
# The torch wheel brings its own CUDA libraries; the CUDA image supplies the matching
# toolkit (nvcc for the flash-attn build) and the container runtime hooks for the driver.
# deploy/engine.Dockerfile.dockerignore keeps the context to the Python sources.

ARG CUDA_VERSION=12.8.1

FROM nvidia/cuda:${CUDA_VERSION}-devel-ubuntu24.04 AS builder
ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
# Distribution packages track the pinned base image; pinning each one would break on
# every Ubuntu security update.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev \
       build-essential \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH

# torch first, from the CUDA index, so `.[engine]` finds it satisfied and never pulls a
# different build. TORCH_INDEX_URL must match CUDA_VERSION's major.minor.
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"

WORKDIR /src
COPY . .
RUN pip install "/src[engine,triton]"

# flash-attn compiles against the installed torch with nvcc (long: raise MAX_JOBS on a big
# builder, lower it when the build runs out of memory).
ARG FLASH_ATTN=0
ARG FLASH_ATTN_VERSION=2.8.3
ARG MAX_JOBS=8
RUN if [ "${FLASH_ATTN}" = "1" ]; then \
        pip install packaging==24.2 ninja==1.11.1.4 psutil==7.0.0 wheel==0.45.1 \
        && MAX_JOBS="${MAX_JOBS}" pip install --no-build-isolation \
           "flash-attn==${FLASH_ATTN_VERSION}"; \
    fi

FROM nvidia/cuda:${CUDA_VERSION}-base-ubuntu24.04
ENV DEBIAN_FRONTEND=noninteractive
# Triton JIT-compiles a small C launcher at run time: it needs a C compiler and Python.h.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-dev gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
RUN useradd --uid 10001 --user-group --create-home --shell /usr/sbin/nologin nanoserve
COPY --from=builder /opt/venv /opt/venv
# Weights come from the mounted model volume, never from the network.
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1
USER 10001:10001
WORKDIR /home/nanoserve
# gRPC (Generation, Engine, health, reflection) and Prometheus /metrics.
EXPOSE 50051 9400
ENTRYPOINT ["nanoserve"]
CMD ["engine", "--model", "/models/model", "--host", "0.0.0.0", "--port", "50051", \
     "--metrics-port", "9400"]
