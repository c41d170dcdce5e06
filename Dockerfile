# One image for every rein Python service; docker-compose.yml picks the service with `command`.
#
#   docker build -t rein .
#   docker build --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu124 -t rein:cu124 .
#
# TORCH_INDEX_URL is the wheel index torch is installed from. The default is PyTorch's
# CPU-only index (about 200 MB instead of several GB of CUDA libraries): the tiny
# policy trains and serves on CPU. Point it at a CUDA index to train on a GPU.
FROM python:3.11-slim

ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG TORCH_SPEC="torch>=2.4,<3"

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

# Then rein and its other dependencies (torch is already satisfied, so PyPI's CUDA wheel is never pulled).
COPY pyproject.toml README.md ./
COPY shared ./shared
COPY services ./services
COPY ops ./ops
RUN pip install . && python -c "import ops.cli, services.engine.app, services.proxy.app"

USER rein
# Overridden per service (python -m services.<name>); `rein` is on PATH for tail/report/status.
CMD ["rein", "--help"]
