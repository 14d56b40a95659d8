# syntax=docker/dockerfile:1
# The extproc router: the package built as a wheel, installed into a slim Python image, run as a
# non-root user. Nothing is written at run time, so the container runs with a read-only root
# filesystem (k8s/base/deployment.yaml mounts an emptyDir at /tmp for good measure).
#
#   docker build -t extproc-router:0.1.0 .
#   docker run --rm -p 9002:9002 -p 9190:9190 -v "$PWD/examples/router.yaml:/etc/extproc/router.yaml:ro" \
#     --read-only extproc-router:0.1.0 serve --config /etc/extproc/router.yaml --listen 0.0.0.0:9002
ARG PYTHON_VERSION=3.11
# The package's version (pyproject.toml; tests/project/test_release.py keeps this default equal to
# it) and the commit, for the image's labels: --build-arg REVISION=$(git rev-parse HEAD).
ARG VERSION=0.1.0

FROM python:${PYTHON_VERSION}-slim AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
# Only what the wheel is made of (.dockerignore keeps the rest out of the context).
COPY pyproject.toml README.md LICENSE ./
COPY extproc ./extproc
# The wheel and every dependency's wheel, so the final stage installs offline.
RUN pip wheel --wheel-dir /wheels .

FROM python:${PYTHON_VERSION}-slim
ARG VERSION
ARG REVISION=unknown
# OCI image annotations: what the image is, at which version and commit, under which licence.
LABEL org.opencontainers.image.title="extproc-router" \
      org.opencontainers.image.description="KV-cache aware Envoy ext_proc router and GIE endpoint picker for vLLM fleets" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.licenses="Apache-2.0"
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
# The wheels are bind-mounted rather than copied, so they add nothing to the image; pip compiles
# the bytecode at install time, while the filesystem is still writable. xds-protos ships older
# copies of opentelemetry-proto's files (same paths); that one is reinstalled last, so the OTLP
# exporter finds its own.
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    pip install --no-index --find-links /wheels extproc-router \
    && pip install --no-index --find-links /wheels --no-deps --force-reinstall \
       "opentelemetry-proto==$(python -c 'import importlib.metadata as m; print(m.version("opentelemetry-proto"))')" \
    && groupadd --system --gid 10001 extproc \
    && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
       --shell /usr/sbin/nologin extproc
# Numeric, so that Kubernetes can check runAsNonRoot without looking the name up.
USER 10001:10001
WORKDIR /tmp
# 9002: ext_proc gRPC and the gRPC health service; 9190: Prometheus /metrics.
EXPOSE 9002 9190
ENTRYPOINT ["extproc"]
CMD ["serve", "--config", "/etc/extproc/router.yaml"]
