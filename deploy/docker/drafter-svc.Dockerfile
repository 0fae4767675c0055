# syntax=docker/dockerfile:1.7
#
# drafter-svc: the internal glance.drafter.v1.Drafter API; runs the draft head on its own device.
#
# Build from the repository root (the context is the Cargo workspace; see .dockerignore):
#   docker build -f deploy/docker/drafter-svc.Dockerfile -t localhost/glance/drafter-svc:dev .
#
# Same recipe as verifier-svc.Dockerfile: libtorch from the pinned PyPI wheel torch==2.13.0 in a
# virtualenv (LIBTORCH_USE_PYTORCH=1, as scripts/setup.sh does); the runtime stage keeps torch's
# lib/ and the nvidia/*/lib directories its RPATH points at, at their build-time absolute paths,
# plus the binaries. The CUDA driver (R580 or newer) comes from the NVIDIA container toolkit when a
# GPU is granted. Also ships the `glance` client (no libtorch), the container health check.

# Base images are build arguments so that a release pins them by digest without editing this file
# (this repository cannot look digests up: no registry access here):
#   docker buildx imagetools inspect debian:bookworm-slim     # -> Digest: sha256:...
#   docker build --build-arg RUNTIME_IMAGE=debian:bookworm-slim@sha256:<digest> \
#                --build-arg RUST_IMAGE=rust:1.95-bookworm@sha256:<digest> ...
# Both must stay on the same Debian release: the build stage's Python (bookworm: 3.11) is what
# deploy/docker/constraints.txt was resolved for, and the runtime stage runs what it links.
ARG RUST_IMAGE=rust:1.95-bookworm
ARG RUNTIME_IMAGE=debian:bookworm-slim

############################################################################### build
FROM ${RUST_IMAGE} AS build
ARG TORCH_VERSION=2.13.0

RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv binutils \
 && rm -rf /var/lib/apt/lists/*

# The virtualenv's path is baked into the binary's RUNPATH: keep it identical in both stages.
ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    LIBTORCH_USE_PYTORCH=1 \
    CARGO_TERM_COLOR=never

# About 2.6 GB (torch + the nvidia-* wheels it depends on); its own layer, cached across source edits.
# deploy/docker/constraints.txt pins every wheel torch pulls in (the CUDA libraries included), so a
# later rebuild copies the same libraries into the runtime stage.
RUN --mount=type=cache,target=/root/.cache/pip \
    --mount=type=bind,source=deploy/docker/constraints.txt,target=/tmp/constraints.txt \
    python3 -m venv "$VIRTUAL_ENV" \
 && pip install --disable-pip-version-check --constraint /tmp/constraints.txt "torch==${TORCH_VERSION}" \
 && python -c "import torch; assert torch.__version__.split('+')[0] == '${TORCH_VERSION}', torch.__version__"

WORKDIR /src
COPY . .

RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/usr/local/cargo/git \
    --mount=type=cache,target=/src/target,id=glance-cargo-target \
    cargo build --release --locked -p drafter-svc -p glance-client --bin drafter-svc --bin glance \
 && install -D -m 0755 target/release/drafter-svc /out/usr/local/bin/drafter-svc \
 && install -D -m 0755 target/release/glance /out/usr/local/bin/glance

# Stage libtorch and the CUDA libraries at their build-time absolute paths; drop what a Rust
# binary never loads (static archives, headers, the Python bindings).
RUN set -eu; \
    torch_lib="$(python -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "lib"))')"; \
    site="$(dirname "$(dirname "$torch_lib")")"; \
    readelf -d /out/usr/local/bin/drafter-svc | grep -E "R(UN)?PATH" | grep -F "$torch_lib" \
      || { echo "drafter-svc's RUNPATH is not $torch_lib"; exit 1; }; \
    mkdir -p "/out$torch_lib"; \
    cp -a "$torch_lib/." "/out$torch_lib/"; \
    rm -f "/out$torch_lib/libtorch_python.so"; \
    for d in "$site"/nvidia/*/lib; do mkdir -p "/out$d"; cp -a "$d/." "/out$d/"; done; \
    find /out -name '*.a' -delete; \
    du -sh /out

############################################################################### runtime
FROM ${RUNTIME_IMAGE} AS runtime

RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --gid 10001 glance \
 && useradd --uid 10001 --gid glance --no-create-home --home-dir /nonexistent \
      --shell /usr/sbin/nologin glance

COPY --from=build /out/ /

# Fail the build, not the pod, if a library does not resolve in the runtime image.
RUN ! ldd /usr/local/bin/drafter-svc | grep -F 'not found' \
 && drafter-svc --version \
 && glance --version

# Caches libtorch/CUDA may write go to /tmp (an emptyDir or tmpfs): the root file system can be
# mounted read-only. NVIDIA_VISIBLE_DEVICES is deliberately not set here: GPUs are granted by the
# orchestrator (compose device reservations, the Kubernetes device plugin), never by the image.
# NVIDIA_REQUIRE_CUDA: the libraries are CUDA 13.0, which needs a driver of branch R580 or newer;
# the NVIDIA container toolkit refuses to start a GPU container on an older driver instead of
# letting the first CUDA call fail (it does not apply without a GPU).
ENV HOME=/tmp \
    XDG_CACHE_HOME=/tmp/.cache \
    CUDA_CACHE_PATH=/tmp/.nv/ComputeCache \
    PYTORCH_KERNEL_CACHE_PATH=/tmp/.cache/torch/kernels \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    NVIDIA_REQUIRE_CUDA="cuda>=13.0" \
    RUST_LOG=info \
    NO_COLOR=1 \
    GLANCE_DRAFTER_KIND=block-head \
    GLANCE_DRAFTER_HEAD=/models/head \
    GLANCE_DRAFTER_TARGET=/models/target \
    GLANCE_DRAFTER_LISTEN=0.0.0.0:50061 \
    GLANCE_DRAFTER_METRICS_LISTEN=0.0.0.0:9091

ARG VERSION=0.1.0
LABEL org.opencontainers.image.title="glance drafter-svc" \
      org.opencontainers.image.description="glance drafter: block-diffusion draft head and candidate trees over gRPC (glance.drafter.v1.Drafter)" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0"

USER 10001:10001
WORKDIR /tmp
# 50061: gRPC (glance.drafter.v1.Drafter, grpc.health.v1.Health); 9091: Prometheus /metrics.
EXPOSE 50061 9091
STOPSIGNAL SIGTERM
ENTRYPOINT ["/usr/local/bin/drafter-svc"]
CMD ["serve"]
