# SuperExec image for this app: runs the ServerApp (superexec-serverapp) or the ClientApps of one
# SuperNode (superexec-clientapp-N) in Flower 1.41 `process` isolation.
#
# Everything the app imports is installed at BUILD time (torch, numpy, scipy, pydantic, ... and
# this package); nothing is installed at run time: runtime dependency installation stays off
# (FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1, no --allow-runtime-dependency-installation).
# The app's code also arrives with every run as the FAB that `flwr run` builds.
#
# Build from the repository root:
#   docker build -f docker/superexec.Dockerfile -t fl-dp-flower/superexec:0.1.0 .
#
# Base: the official flwr/superexec image, Python 3.11 variant (this project requires
# Python >=3.11,<3.12). It runs as the non-root user `app` (uid 49999, HOME=/app) with the venv
# /python/venv on PATH. PyPI's Linux x86_64 torch wheels bundle the CUDA runtime; GPU hosts need
# only the NVIDIA driver and the NVIDIA Container Toolkit.
ARG FLWR_VERSION=1.41.0
ARG BASE_VARIANT=py3.11-ubuntu24.04
FROM flwr/superexec:${FLWR_VERSION}-${BASE_VARIANT}

ENV FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1 \
    FLWR_TELEMETRY_ENABLED=0 \
    FLWR_DISABLE_UPDATE_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app/build
COPY --chown=app:app pyproject.toml README.md server_app.py client_app.py ./
COPY --chown=app:app scripts/constraints.txt ./constraints.txt
COPY --chown=app:app fl_dp_flower ./fl_dp_flower

# 1. the app's dependencies from pyproject.toml, except flwr (the base image's flwr is kept;
#    flwr[simulation] would pull Ray, which the deployment engine does not use), with torch and
#    torchvision at the versions the project is tested with (scripts/constraints.txt; pyproject.toml
#    only gives ranges, and a newer torch would otherwise be built into the image)
# 2. this package itself, without re-resolving dependencies
# 3. build-time smoke test: the exact flwr line and every module the Server/ClientApp import
RUN python -c "import tomllib; deps = tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']; print('\n'.join(d for d in deps if not d.replace(' ', '').startswith('flwr')))" > /tmp/requirements.txt \
 && python -m pip install -c constraints.txt -r /tmp/requirements.txt \
 && python -m pip install --no-deps . \
 && rm -rf /app/build /tmp/requirements.txt \
 && python -c "import flwr, torch, fl_dp_flower.app.serverapp, fl_dp_flower.app.clientapp; assert flwr.__version__.startswith('1.41'), flwr.__version__; print('flwr', flwr.__version__, 'torch', torch.__version__)"

# ledger + model outputs (run config output-dir = "/app/outputs"; a named volume mounted here
# inherits this directory's ownership) and the read-only data mount point (node config data-dir)
WORKDIR /app
RUN mkdir -p /app/outputs /app/data

ENTRYPOINT ["flower-superexec"]
