# syntax=docker/dockerfile:1
#
# The kvbus image: the coordinator, the group schedulers and `kvbus selftest`, as the Helm
# chart (helm/kvbus) runs them.
#
#   docker build -t kvbus:0.2.0 .
#
# CPU-only torch and no model weights. It runs as an unprivileged user (uid 10001) and works
# with a read-only root filesystem: kvbus writes only to /tmp and ~/.cache, which the chart
# mounts as emptyDirs.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# ---- build: a virtualenv with torch (CPU), kvbus and the telemetry exporters -----------------
FROM ${PYTHON_IMAGE} AS build

ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_NO_INPUT=1
RUN python -m venv /opt/kvbus
ENV PATH=/opt/kvbus/bin:$PATH

# torch first, from the CPU wheel index: from the default index the same version is the CUDA
# build, several GB more. kvbus's own `torch>=2.4` is then already satisfied.
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"

WORKDIR /src
COPY pyproject.toml README.md ./
COPY kvbus/ kvbus/
COPY bus/ bus/
COPY codecs/ codecs/
COPY group_scheduler/ group_scheduler/
COPY coordinator/ coordinator/
COPY cachetier/ cachetier/
COPY net/ net/
COPY app/ app/
COPY integrations/ integrations/
# kvbus.telemetry imports these only when tracing (OTEL_EXPORTER_OTLP_ENDPOINT) or metrics
# (KVBUS_METRICS_PORT) are configured, which the chart does.
RUN pip install . \
        opentelemetry-exporter-otlp-proto-http \
        opentelemetry-exporter-otlp-proto-grpc \
        opentelemetry-exporter-prometheus \
    && kvbus --help > /dev/null

# ---- runtime: the virtualenv on a clean base, a non-root user ---------------------------------
FROM ${PYTHON_IMAGE} AS runtime

RUN groupadd --system --gid 10001 kvbus \
    && useradd --system --uid 10001 --gid kvbus --home-dir /home/kvbus --create-home \
        --shell /usr/sbin/nologin kvbus

COPY --from=build /opt/kvbus /opt/kvbus

# HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE: nothing is downloaded at run time.
# MPLCONFIGDIR: matplotlib (benchmark plots) would otherwise write under ~/.config.
ENV PATH=/opt/kvbus/bin:$PATH \
    HOME=/home/kvbus \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    MPLCONFIGDIR=/tmp/matplotlib

USER 10001:10001
WORKDIR /home/kvbus
ENTRYPOINT ["kvbus"]
CMD ["--help"]
