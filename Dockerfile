# syntax=docker/dockerfile:1.7
# The JoyNexus image every manifest of deployments/ names (ghcr.io/joynexus/joynexus): the pinned
# stack installed exactly as on a laptop, by scripts/bootstrap (torch/torchvision first, the whole
# stack in ONE resolver call held to requirements/lock.txt, lerobot --no-deps; Mesa >= 25 for
# ManiSkill3's Vulkan through scripts/install-system-deps). docs/deployment.md lists what it holds.
#
#   docker build -t ghcr.io/joynexus/joynexus:0.1.0 .                               # CUDA (default)
#   docker build --build-arg VARIANT=cpu -t ghcr.io/joynexus/joynexus:0.1.0-cpu .   # CPU only
#
# VARIANT=cuda: torch 2.14.1 from PyPI, the CUDA 13 build whose nvidia-* runtime wheels
#   requirements/lock.txt pins; the node provides the driver (EKS AL2023 NVIDIA AMI, driver >= 580).
# VARIANT=cpu: the same versions from the PyTorch CPU index (2.14.1+cpu), no CUDA libraries.
ARG PYTHON_IMAGE=python:3.11.13-slim-bookworm
FROM ${PYTHON_IMAGE}

ARG VARIANT=cuda
ARG TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu

LABEL org.opencontainers.image.source="https://github.com/joynexus/joynexus" \
      org.opencontainers.image.title="joynexus" \
      org.opencontainers.image.description="JoyNexus: Ray services, tenant API, Prefect flows, MLflow server"

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    JOYNEXUS_VENV=/opt/venv \
    JOYNEXUS_PYTHON=/usr/local/bin/python3.11 \
    PATH=/opt/venv/bin:$PATH

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# wget: KubeRay's injected probes call it; tini: a reaped PID 1 for ray / prefect / mlflow.
RUN apt-get update -qq \
 && apt-get install -y -q --no-install-recommends wget tini ca-certificates \
 && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/joynexus
COPY . /opt/joynexus

# scripts/bootstrap itself: the same three pinned steps and the same system packages as a laptop.
RUN test "$VARIANT" = cuda -o "$VARIANT" = cpu \
 && if [ "$VARIANT" = cpu ]; then export PIP_EXTRA_INDEX_URL="$TORCH_CPU_INDEX"; fi \
 && scripts/bootstrap \
 && rm -rf /var/lib/apt/lists/* /root/.cache \
 && python -c "import joynexus, torch, ray, mlflow, prefect; print('joynexus', torch.__version__, ray.__version__)"

# Non-root, with a fixed UID the manifests' securityContext names (runAsUser 10001).
RUN echo "export PATH=/opt/venv/bin:\$PATH" > /etc/profile.d/joynexus.sh \
 && groupadd --gid 10001 joynexus \
 && useradd --uid 10001 --gid 10001 --home-dir /tmp/home --no-create-home --shell /usr/sbin/nologin joynexus
USER 10001:10001

# Kubernetes probes (deployments/) check each process; the image has no single health command.
HEALTHCHECK NONE
ENTRYPOINT ["/usr/bin/tini", "--"]
CMD ["joynexus", "--help"]
