# syntax=docker/dockerfile:1.7
#
# A model bundle: one target model and its draft head as image layers, the default source of the
# Kubernetes model loader (Job glance-model-loader copies /bundle/target and /bundle/head to the
# versioned paths on the model volume; deploy/k8s/base/model-loader/load.sh). Registries then carry
# the weights like any other artefact: pulled once per node, cached, mirrored into air-gapped
# clusters.
#
# Build from the repository root. The defaults are the committed toy models (the dev overlay):
#   docker build -f deploy/docker/model-bundle.Dockerfile -t localhost/glance/model-bundle:toy .
# A real model: put it inside the build context (e.g. ./models/, which only this Dockerfile's own
# model-bundle.Dockerfile.dockerignore admits) and name the directories:
#   docker build -f deploy/docker/model-bundle.Dockerfile \
#     --build-arg TARGET_DIR=models/Qwen3-VL-8B-Instruct --build-arg HEAD_DIR=models/qwen3-vl-8b-head \
#     -t REGISTRY/glance/model-bundle:qwen3-vl-8b-instruct .
#
# busybox provides the sh and cp the loader's fetch step runs; the base is a build argument so a
# release can pin it by digest (--build-arg BASE_IMAGE=busybox:1.37.0@sha256:<digest>).

ARG BASE_IMAGE=busybox:1.37.0

FROM ${BASE_IMAGE}
ARG TARGET_DIR=models/toy-target
ARG HEAD_DIR=models/toy-head
# Readable by every uid (the loader runs as 10001, and a checkpoint may have been written 0600);
# the loader resets the modes to a+rX,go-w when it publishes.
COPY --chmod=0755 ${TARGET_DIR} /bundle/target
COPY --chmod=0755 ${HEAD_DIR} /bundle/head
LABEL org.opencontainers.image.title="glance model bundle" \
      org.opencontainers.image.description="a target model (/bundle/target) and its draft head (/bundle/head) for the glance model loader"
USER 10001:10001
WORKDIR /bundle
# Not a service: the loader runs `sh /loader/load.sh fetch` in it.
CMD ["/bin/sh", "-c", "ls -l /bundle/target /bundle/head"]
