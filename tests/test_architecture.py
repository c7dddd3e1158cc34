"""The layering the folder tree promises: no import circles, one direction between the server's gRPC and HTTP
sides and the client, short functions in the buffer, and one implementation per registered component kind."""

from __future__ import annotations

import ast
import inspect
import subprocess
import sys
from pathlib import Path

import pytest

from replayd.server import components
from replayd.wire import components as options

ROOT = Path(__file__).resolve().parents[1]
# The installed package's parts and the repository folders that hold them (setup.py's FOLDERS).
PACKAGES = {"replayd": "replayd", "replayd.server": "service", "replayd.client": "client", "replayd.wire": "proto"}


def module_name(package: str, folder: str, path: Path) -> str:
    parts = path.relative_to(ROOT / folder).with_suffix("").parts
    return ".".join([package, *(parts[:-1] if parts[-1] == "__init__" else parts)])


def modules() -> dict[str, Path]:
    return {module_name(package, folder, path): path for package, folder in PACKAGES.items()
            for path in (ROOT / folder).rglob("*.py")
            if package != "replayd" or path.parent == ROOT / folder}


def imports(path: Path, known: dict[str, Path]) -> set[str]:
    """The project modules `path` imports, type-only imports (under TYPE_CHECKING) and imports inside
    functions included."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: imports are absolute"
            names = [f"{node.module}.{alias.name}" for alias in node.names] + [node.module]
        else:
            continue
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name:
                found.add(name)
    return found


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(path, known) - {name} for name, path in known.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Every import circle, as a path that starts and ends at the same module (Tarjan's components)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in edges.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def test_no_module_imports_itself_through_others() -> None:
    assert cycles(graph()) == []


def test_cycles_are_found() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


@pytest.mark.parametrize(("importer", "imported"), [
    ("replayd.server.http", "replayd.server.grpc_server"),
    ("replayd.server.grpc_server", "replayd.server.http"),
    ("replayd.client", "replayd.server.grpc_server"),
    ("replayd.client", "replayd.server.http"),
    ("replayd.wire", "replayd.server"),
    ("replayd.wire", "replayd.client"),
    ("replayd.server.buffers", "replayd.server.grpc_server"),
])
def test_one_side_does_not_import_the_other(importer: str, imported: str) -> None:
    crossing = sorted((source, target) for source, targets in graph().items() for target in targets
                      if (source == importer or source.startswith(importer + "."))
                      and (target == imported or target.startswith(imported + ".")))
    assert crossing == []


def external_imports(path: Path) -> set[str]:
    """The top-level packages `path` imports (inside functions too)."""
    tree = ast.parse(path.read_text())
    names = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
             for alias in node.names}
    return names | {(node.module or "").split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}


def test_the_server_never_imports_torch_or_ray() -> None:
    for path in (ROOT / "service").rglob("*.py"):
        assert not {"torch", "ray"} & external_imports(path), path


def test_only_the_ray_launcher_imports_ray() -> None:
    importers = sorted(name for name, path in modules().items() if "ray" in external_imports(path))
    assert importers, "the Ray launcher imports Ray"
    assert all(name == "replayd.client.ray" or name.startswith("replayd.client.ray.") for name in importers), importers


def test_the_server_the_client_and_the_programs_load_without_ray() -> None:
    """`replayd serve`, the clients, actors, learners and the demo run where Ray is not installed: none of them
    imports it (replayd.client.sharded imports replayd.client.ray only for a ray:NAME address), and neither does
    importing replayd.client.ray and its command line (`replayd ray --help`) before a name of its API is used."""
    code = ("import sys, replayd.server.cli, replayd.server.server, replayd.client, replayd.client.sharded, "
            "replayd.client.actor, replayd.client.learner, replayd.client.demo, replayd.client.ray, "
            "replayd.client.ray.cli; "
            "print(sorted(name for name in sys.modules if name == 'ray' or name.startswith('ray.')))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_the_buffers_functions_are_short() -> None:
    longest = []
    for path in (ROOT / "service" / "buffers").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                if lines >= 60:
                    longest.append((path.name, node.name, lines))
    assert longest == []


@pytest.mark.parametrize("role", sorted(components.ROLES))
def test_every_component_kind_has_one_implementation_and_one_wire_message(role: str) -> None:
    """Each kind registered for a role is a field of the role's `oneof kind` on the wire, and the server builds
    it with a class of the role's interface."""
    kinds = options.kinds(role)
    container = {"sampler": "SamplerConfig", "remover": "RemoverConfig", "rate_limiter": "RateLimiterConfig",
                 "mode": "BatchMode"}[role]
    from replayd.wire import replay_pb2 as pb

    oneof = getattr(pb, container).DESCRIPTOR.oneofs_by_name["kind"]
    assert sorted(kinds) == sorted(field.name for field in oneof.fields)
    for kind, option_class in kinds.items():
        implementation = components.IMPLEMENTATIONS[option_class]
        assert issubclass(implementation, components.ROLES[role]), (kind, implementation)
        assert not inspect.isabstract(implementation), (kind, implementation)


@pytest.mark.parametrize("role", sorted(components.ROLES))
def test_options_go_round_trip_through_every_encoding(role: str) -> None:
    examples = {"sampler": [options.Uniform(), options.Prioritized(0.3)],
                "remover": [options.Fifo(), options.MaxTimesSampled(4)],
                "rate_limiter": [options.MinSize(3), options.SampleToInsertRatio(2.0, 5, 10.0)],
                "mode": [options.Transitions(3, 0.9), options.Geometric(0.5), options.States()]}[role]
    for example in examples:
        assert options.from_config(role, example.to_config()) == example
        assert options.from_proto(role, example.to_proto()) == example
        built = components.build(example)
        assert built.options == example and built.to_config() == example.to_config()
