# syntax=docker/dockerfile:1.7
# kvoffload images. Targets:
#   operator          the kopf operator (no torch, no lmcache)
#   sidecar           LMCache's cache server + kvoffload's supervisor, health and /metrics
#   connector-bundle  files the operator's init container copies into TensorRT-LLM pods
#   trtllm            optional: TensorRT-LLM release image with the connector baked in
#
#   docker build --target operator -t kvoffload/operator:0.1.0 .

ARG PYTHON_IMAGE=python:3.12.8-slim-bookworm
ARG BUNDLE_BASE_IMAGE=busybox:1.37.0-musl
ARG TRTLLM_IMAGE=nvcr.io/nvidia/tensorrt-llm/release:1.3.0rc26
# lmcache 0.5.6's compiled CUDA extension (lmcache.cuda_ops) was built against
# torch 2.13.0 (the build pin in its source distribution's pyproject.toml); with
# another torch it fails to load and LMCache silently falls back to slow copies,
# so the sidecar stage imports it (a version compare is not enough).
ARG TORCH_VERSION=2.13.0
ARG LMCACHE_VERSION=0.5.6

# --- build kvoffload's four wheels once ------------------------------------------
# common (the shared floor), operator, sidecar, connector: each folder is its own distribution.
FROM ${PYTHON_IMAGE} AS wheels
WORKDIR /src
COPY common/ common/
COPY operator/ operator/
COPY sidecar/ sidecar/
COPY connector/ connector/
# hadolint ignore=DL3013
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels ./common ./operator ./sidecar ./connector

# --- operator ------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS operator-venv
COPY --from=wheels /wheels /wheels
# Versions are pinned by the operator distribution's dependencies; it never pulls torch or lmcache.
# hadolint ignore=DL3013
RUN python -m venv /opt/venv \
    && /opt/venv/bin/pip install --no-cache-dir /wheels/kvoffload_common-*.whl /wheels/kvoffload_operator-*.whl

FROM ${PYTHON_IMAGE} AS operator
LABEL org.opencontainers.image.title="kvoffload-operator" \
      org.opencontainers.image.description="Injects an LMCache cache server and the kvoffload KV connector into annotated TensorRT-LLM workloads"
COPY --from=operator-venv /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
USER 65532:65532
EXPOSE 8080 8081
ENTRYPOINT ["kvoffload-operator"]

# --- sidecar -------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS sidecar-venv
ARG TORCH_VERSION
ARG LMCACHE_VERSION
COPY --from=wheels /wheels /wheels
# torch first, pinned to the build lmcache's extension expects; then the rest.
# hadolint ignore=DL3013
RUN python -m venv /opt/venv \
    && /opt/venv/bin/pip install --no-cache-dir "torch==${TORCH_VERSION}" \
    && /opt/venv/bin/pip install --no-cache-dir "lmcache==${LMCACHE_VERSION}" /wheels/kvoffload_common-*.whl /wheels/kvoffload_sidecar-*.whl \
    && /opt/venv/bin/python -c "import torch, lmcache; assert torch.__version__.startswith('${TORCH_VERSION}'), torch.__version__" \
    && /opt/venv/bin/python -c "import torch, lmcache.cuda_ops"

FROM ${PYTHON_IMAGE} AS sidecar
LABEL org.opencontainers.image.title="kvoffload-sidecar" \
      org.opencontainers.image.description="LMCache multi-process cache server beside TensorRT-LLM, with health, one /metrics per pod and supervision"
COPY --from=sidecar-venv /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    LMCACHE_TRACK_USAGE=false \
    DO_NOT_TRACK=1
USER 65532:65532
EXPOSE 9455
ENTRYPOINT ["kvoffload-sidecar"]

# --- connector bundle ------------------------------------------------------------
# TensorRT-LLM's image already has torch, numpy, pydantic, pyzmq and CUDA; the bundle carries
# kvoffload's connector distribution, the floor it stands on and lmcache (python/), and the packages lmcache imports that the image
# lacks (deps/, appended to the END of sys.path by the connector). hack/build_bundle.py is the
# one recipe: the tests build the bundle with it too, and load it in an image-shaped environment.
FROM wheels AS bundle-build
ARG LMCACHE_VERSION
COPY hack/build_bundle.py hack/bundle-requirements.txt hack/
ENV PIP_NO_CACHE_DIR=1
RUN python hack/build_bundle.py --out /kvoffload-bundle --lmcache-version "${LMCACHE_VERSION}" \
        --dist /wheels/kvoffload_common-*.whl --dist /wheels/kvoffload_connector-*.whl

FROM ${BUNDLE_BASE_IMAGE} AS connector-bundle
LABEL org.opencontainers.image.title="kvoffload-connector-bundle" \
      org.opencontainers.image.description="kvoffload's TensorRT-LLM KV connector for Python 3.12, copied into TensorRT-LLM pods by an init container"
COPY --from=bundle-build /kvoffload-bundle /kvoffload-bundle
USER 65532:65532
# The same copy as the operator's init container command (kvoffload.contract.BUNDLE_COPY_COMMAND).
ENTRYPOINT ["cp", "-R", "/kvoffload-bundle/.", "/opt/kvoffload/"]

# --- optional: TensorRT-LLM with the connector baked in ------------------------
FROM ${TRTLLM_IMAGE} AS trtllm
COPY --from=bundle-build /kvoffload-bundle /opt/kvoffload
# Prepended to the base image's own PYTHONPATH, never replacing it.
ENV PYTHONPATH=/opt/kvoffload/python${PYTHONPATH:+:${PYTHONPATH}} \
    PYTHONHASHSEED=0
