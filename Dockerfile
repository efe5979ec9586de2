# syntax=docker/dockerfile:1.7
# The JoyNexus images every manifest of deployments/ names, built by scripts/build-images:
#   ghcr.io/joynexus/joynexus      VARIANT=cuda  the Ray GPU workers (torch 2.14.1, the CUDA 13 build
#                                  whose nvidia-* wheels requirements/lock.txt pins; the node has the driver)
#   ghcr.io/joynexus/joynexus-cpu  VARIANT=cpu   every other pod: API, Ray head, services Job, MLflow,
#                                  Prefect (torch 2.14.1+cpu from the PyTorch CPU index; no CUDA libraries)
# The stack is installed exactly as on a laptop, by scripts/bootstrap (torch/torchvision first, the
# whole stack in ONE resolver call held to requirements/lock.txt, lerobot --no-deps), without the
# `dev` extra. Layers, slowest-changing first, so an edit of the source rebuilds only the last one:
#   system  Debian packages (tini, wget, Vulkan/Mesa >= 25 and FFmpeg from trixie's own suite)
#   deps    the Python stack, from the files that pin it and an empty package skeleton
#   app     the source, over the skeleton (the editable install resolves to /opt/joynexus)
#
#   scripts/build-images 0.1.0      # resolves the base image's digest and builds both variants
#
# The base is pinned by digest (PYTHON_IMAGE=python:3.11.13-slim-trixie@sha256:...); the build
# refuses a tag alone unless ALLOW_UNPINNED_BASE=1 (a local experiment). Trixie ships Mesa 25, so
# no backports suite is involved (bookworm-backports moves to archive.debian.org with bookworm).
ARG PYTHON_IMAGE=python:3.11.13-slim-trixie

FROM ${PYTHON_IMAGE} AS system
ARG PYTHON_IMAGE
ARG ALLOW_UNPINNED_BASE=0
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
RUN case "$PYTHON_IMAGE" in *@sha256:*) ;; *) [ "$ALLOW_UNPINNED_BASE" = 1 ] \
      || { echo "PYTHON_IMAGE=$PYTHON_IMAGE: pin the base by digest (scripts/build-images does)" >&2; exit 1; } ;; esac
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    JOYNEXUS_VENV=/opt/venv \
    JOYNEXUS_PYTHON=/usr/local/bin/python3.11 \
    PATH=/opt/venv/bin:$PATH
# wget: KubeRay's injected probes call it; tini: a reaped PID 1 for ray / prefect / mlflow.
COPY scripts/install-system-deps /tmp/install-system-deps
RUN apt-get update -qq \
 && apt-get install -y -q --no-install-recommends wget tini ca-certificates \
 && /tmp/install-system-deps \
 && rm -rf /var/lib/apt/lists/* /tmp/install-system-deps

FROM system AS deps
ARG VARIANT=cuda
ARG TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu
WORKDIR /opt/joynexus
# Only what decides the installed stack; the package directories are empty skeletons here.
COPY pyproject.toml ./
COPY requirements/ requirements/
COPY scripts/bootstrap scripts/install-system-deps scripts/
COPY plugins/lerobot_policy_joynexus/pyproject.toml plugins/lerobot_policy_joynexus/
RUN test "$VARIANT" = cuda -o "$VARIANT" = cpu \
 && mkdir -p joynexus plugins/lerobot_policy_joynexus/lerobot_policy_joynexus && touch README.md \
 && touch joynexus/__init__.py plugins/lerobot_policy_joynexus/lerobot_policy_joynexus/__init__.py \
 && if [ "$VARIANT" = cpu ]; then export PIP_EXTRA_INDEX_URL="$TORCH_CPU_INDEX"; fi \
 && JOYNEXUS_EXTRAS="" JOYNEXUS_SKIP_SYSTEM_DEPS=1 scripts/bootstrap \
 && rm -rf /root/.cache

FROM deps AS app
COPY . /opt/joynexus
RUN python -c "import joynexus, torch, ray, mlflow, prefect; print('joynexus', torch.__version__, ray.__version__)" \
 && ! python -c "import pytest" 2>/dev/null \
 && echo "export PATH=/opt/venv/bin:\$PATH" > /etc/profile.d/joynexus.sh \
 && groupadd --gid 10001 joynexus \
 && useradd --uid 10001 --gid 10001 --home-dir /tmp/home --no-create-home --shell /usr/sbin/nologin joynexus
# Non-root, with a fixed UID the manifests' securityContext names (runAsUser 10001).
USER 10001:10001

LABEL org.opencontainers.image.source="https://github.com/joynexus/joynexus" \
      org.opencontainers.image.title="joynexus" \
      org.opencontainers.image.description="JoyNexus: Ray services, tenant API, Prefect flows, MLflow server"
# Kubernetes probes (deployments/) check each process; the image has no single health command.
HEALTHCHECK NONE
ENTRYPOINT ["/usr/bin/tini", "--"]
CMD ["joynexus", "--help"]
