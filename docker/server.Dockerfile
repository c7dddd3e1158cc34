# The replay server: numpy, pyarrow, grpcio, FastAPI. No torch.
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}
WORKDIR /app
COPY constraints.txt pyproject.toml README.md ./
COPY service ./service
COPY client ./client
RUN pip install --no-cache-dir --constraint constraints.txt .
EXPOSE 50051 8080
CMD ["replayd", "serve", "--host", "0.0.0.0", "--port", "50051", "--http-port", "8080"]
