# One image for every rein Python service; docker-compose.yml picks the service with `command`.
#
#   docker build -t rein:local .
#   docker build --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu124 -t rein:cu124 .
#   deploy/images.sh build      the same, offline: Debian's Python as the base, every wheel from a local index
#
# TORCH_INDEX_URL is the wheel index torch is installed from. The default is PyTorch's
# CPU-only index (about 200 MB instead of several GB of CUDA libraries): the tiny
# policy trains and serves on CPU. Point it at a CUDA index to train on a GPU.
# PYTHON_IMAGE is the base: python:3.11-slim, or anything that has `python` and `pip` on PATH.
# PIP_INDEX_URL (read by pip itself) is where everything else comes from.
ARG PYTHON_IMAGE=python:3.11-slim
FROM ${PYTHON_IMAGE}

ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG TORCH_SPEC="torch>=2.4,<3"
ARG PIP_INDEX_URL=https://pypi.org/simple

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# Non-root user; /data holds the named volumes (weights, runs), created here so a fresh
# named volume inherits this ownership.
RUN useradd --uid 10001 --user-group --create-home --home-dir /home/rein rein \
    && mkdir -p /app /data/weights /data/runs \
    && chown -R rein:rein /data

WORKDIR /app

# torch first, from its own index, in its own layer: it is the big one and changes rarely.
RUN pip install --index-url "${TORCH_INDEX_URL}" "${TORCH_SPEC}"

# Then rein's other dependencies, read from pyproject.toml alone (torch is already satisfied, so
# PyPI's CUDA wheel is never pulled): editing the code does not reinstall them.
COPY pyproject.toml ./
RUN python -c "import subprocess, sys, tomllib; \
deps = tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']; \
subprocess.run([sys.executable, '-m', 'pip', 'install', *deps], check=True)"

# Then rein itself.
COPY README.md ./
COPY shared ./shared
COPY services ./services
COPY ops ./ops
RUN pip install --no-deps . && python -c "import ops.cli, services.engine.app, services.proxy.app"

USER rein
# Overridden per service (python -m services.<name>); `rein` is on PATH for tail/report/status.
CMD ["rein", "--help"]
