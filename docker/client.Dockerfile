# Actors and learners: the client library with torch (CPU wheel by default; pass a CUDA base image and
# TORCH_INDEX_URL for GPUs), gymnasium, safetensors.
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
WORKDIR /app
COPY constraints.txt pyproject.toml README.md ./
COPY service ./service
COPY client ./client
RUN pip install --no-cache-dir --extra-index-url ${TORCH_INDEX_URL} --constraint constraints.txt '.[learner]'
# Only the installed package from here on (a source copy in the working directory would shadow it for
# `python -c`); compile the sampling kernels into numba's on-disk cache, which numba keys by the source
# path the containers import, now rather than at every container start.
RUN rm -rf service client && python -c "import service.samplers.kernels as k; print('numba cache for', k.__file__)"
