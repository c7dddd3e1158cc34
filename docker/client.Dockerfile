# Actors and learners: the client library with torch (CPU wheel by default; pass a CUDA base image and
# TORCH_INDEX_URL for GPUs; it needs Python 3.11 and its headers), gymnasium, safetensors.
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
WORKDIR /app
COPY constraints.txt pyproject.toml setup.py README.md ./
COPY service ./service
COPY client ./client
# The sampling kernels are C (service/samplers/_kernels.c): a compiler is installed for the build and removed
# after it. The build pins numpy to the version it then runs with (PIP_CONSTRAINT reaches pip's build step).
RUN apt-get update && apt-get install --yes --no-install-recommends gcc libc6-dev \
    && PIP_CONSTRAINT=/app/constraints.txt pip install --no-cache-dir --extra-index-url ${TORCH_INDEX_URL} --constraint constraints.txt '.[learner]' \
    && apt-get purge --yes --auto-remove gcc libc6-dev && rm -rf /var/lib/apt/lists/*
# Only the installed package from here on (a source copy in the working directory would shadow it).
RUN rm -rf service client setup.py build replayd.egg-info && python -c "import service.samplers.kernels"
