# syntax=docker/dockerfile:1
# Router image: slim Python, no torch, no CUDA, no model weights (the router fetches the
# tokenizer from an engine). Build from the repository root:
#   docker build -f deploy/router.Dockerfile -t nanoserve-router:0.1.0 .
# deploy/router.Dockerfile.dockerignore keeps the context to the Python sources.

FROM python:3.11.13-slim-bookworm AS builder
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
COPY . .
# No extras: the base dependencies are exactly what the router imports.
RUN pip install . \
    && python -c "import importlib.util as u, sys; sys.exit(u.find_spec('torch') is not None)"

FROM python:3.11.13-slim-bookworm
RUN useradd --uid 10001 --user-group --create-home --shell /usr/sbin/nologin nanoserve
COPY --from=builder /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1
USER 10001:10001
WORKDIR /home/nanoserve
# gRPC (Generation, health, reflection) and Prometheus /metrics.
EXPOSE 50050 9401
ENTRYPOINT ["nanoserve"]
CMD ["router", "--engine-dns", "nanoserve-engine:50051", "--host", "0.0.0.0", \
     "--port", "50050", "--metrics-port", "9401"]
