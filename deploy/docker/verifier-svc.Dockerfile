# syntax=docker/dockerfile:1.7
#
# verifier-svc: the public glance.v1.Generation API; owns the target VLM. Also ships the `glance`
# client (no libtorch): the health check of compose and of the TLS probes, and handy inside a pod.
#
# Build from the repository root (the context is the Cargo workspace; see .dockerignore):
#   docker build -f deploy/docker/verifier-svc.Dockerfile -t localhost/glance/verifier-svc:dev .
#
# libtorch comes from the pinned PyPI wheel torch==2.13.0 (the CUDA 13 build, which also runs on
# CPU), exactly as scripts/setup.sh gets it: a virtualenv with torch and LIBTORCH_USE_PYTORCH=1.
# The runtime stage keeps only torch's lib/ directory, the nvidia/*/lib directories that torch's
# RPATH ($ORIGIN/../../nvidia/...) points at, and the binaries, at the same absolute paths as in
# the build stage, so the binaries' RUNPATH (set by build-support/link_libtorch.rs) resolves
# without LD_LIBRARY_PATH. The CUDA driver (libcuda.so, branch R580 or newer for CUDA 13) is not in
# the image: the NVIDIA container toolkit mounts it when the container is given a GPU; without one
# the service runs on CPU.

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

# The virtualenv's path is baked into the binaries' RUNPATH: keep it identical in both stages.
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
    cargo build --release --locked -p verifier-svc -p glance-client --bin verifier-svc --bin glance \
 && install -D -m 0755 target/release/verifier-svc /out/usr/local/bin/verifier-svc \
 && install -D -m 0755 target/release/glance /out/usr/local/bin/glance

# Stage libtorch and the CUDA libraries at their build-time absolute paths; drop what a Rust
# binary never loads (static archives, headers, the Python bindings).
RUN set -eu; \
    torch_lib="$(python -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "lib"))')"; \
    site="$(dirname "$(dirname "$torch_lib")")"; \
    readelf -d /out/usr/local/bin/verifier-svc | grep -E "R(UN)?PATH" | grep -F "$torch_lib" \
      || { echo "verifier-svc's RUNPATH is not $torch_lib"; exit 1; }; \
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
RUN ! ldd /usr/local/bin/verifier-svc | grep -F 'not found' \
 && verifier-svc --version \
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
    GLANCE_MODEL=/models/target \
    GLANCE_LISTEN=0.0.0.0:50051 \
    GLANCE_METRICS_LISTEN=0.0.0.0:9090

ARG VERSION=0.1.0
LABEL org.opencontainers.image.title="glance verifier-svc" \
      org.opencontainers.image.description="glance verifier: serves a Qwen-VL target over gRPC (glance.v1.Generation)" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0"

USER 10001:10001
WORKDIR /tmp
# 50051: gRPC (glance.v1.Generation, grpc.health.v1.Health, reflection); 9090: Prometheus /metrics.
EXPOSE 50051 9090
STOPSIGNAL SIGTERM
ENTRYPOINT ["/usr/local/bin/verifier-svc"]
