# The replay server: numpy, pyarrow, grpcio, FastAPI. No torch.
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}
WORKDIR /app
COPY constraints.txt pyproject.toml README.md ./
COPY service ./service
COPY client ./client
RUN pip install --no-cache-dir --constraint constraints.txt .
EXPOSE 50051
CMD ["sh", "-c", "replayd serve --host ${REPLAYD_HOST} --port ${REPLAYD_PORT} --instance ${REPLAYD_INSTANCE} --max-message-mb ${REPLAYD_MAX_MESSAGE_MB}"]
