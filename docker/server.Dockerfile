# The replay server: numpy, pyarrow, grpcio, FastAPI. No torch.
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}
WORKDIR /app
COPY constraints.txt pyproject.toml README.md ./
COPY service ./service
COPY client ./client
RUN pip install --no-cache-dir --constraint constraints.txt .
# Only the installed package from here on (a source copy in the working directory would shadow it for
# `python -c`); compile the sampling kernels into numba's on-disk cache, which numba keys by the source
# path the containers import, now rather than at every container start.
RUN rm -rf service client && python -c "import service.samplers.kernels as k; print('numba cache for', k.__file__)"
EXPOSE 50051 8080
# The container's own network is private; publish ports deliberately, and set REPLAYD_TOKEN to require a
# bearer token from every client (the server reads it from the environment).
CMD ["replayd", "serve", "--host", "0.0.0.0", "--port", "50051", "--http-port", "8080", "--insecure-bind-all"]
