# The replay server: numpy, pyarrow, grpcio, FastAPI. No torch.
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}
WORKDIR /app
COPY constraints.txt pyproject.toml setup.py README.md ./
COPY service ./service
COPY client ./client
# The sampling kernels are C (service/samplers/_kernels.c): a compiler is installed for the build and removed
# after it. The build pins numpy to the version it then runs with (PIP_CONSTRAINT reaches pip's build step).
RUN apt-get update && apt-get install --yes --no-install-recommends gcc libc6-dev \
    && PIP_CONSTRAINT=/app/constraints.txt pip install --no-cache-dir --constraint constraints.txt . \
    && apt-get purge --yes --auto-remove gcc libc6-dev && rm -rf /var/lib/apt/lists/*
# Only the installed package from here on (a source copy in the working directory would shadow it).
RUN rm -rf service client setup.py build replayd.egg-info && python -c "import service.samplers.kernels"
EXPOSE 50051 8080
# The container's own network is private; publish ports deliberately, and set REPLAYD_TOKEN to require a
# bearer token from every client (the server reads it from the environment).
CMD ["replayd", "serve", "--host", "0.0.0.0", "--port", "50051", "--http-port", "8080", "--insecure-bind-all"]
