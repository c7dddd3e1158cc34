"""On-policy rollout buffer: one (T steps, N env slots) rollout in shared memory, reused forever.

Every column is allocated once, at create time, as a (T, N, *cell_shape) array in one POSIX
shared-memory segment. Actors push rectangles (a time range x an env-slot range) that are copied
straight into place, so an update never transposes lists, concatenates, or allocates a rollout.

Lifecycle of one rollout, all under one policy version v:
  push(v, ...) until every (step, env) cell is filled -> minibatches(...) (GAE runs on the first call)
  -> finish_rollout(v + k) clears the fill mask for the next rollout (the arrays are only overwritten).

Error kinds (replayd.wire.errors; the servicer maps them to gRPC codes):
  InvalidArgument     malformed push or request: unknown/missing field, wrong dtype or shape, range
                      outside the buffer, bootstrap value missing/misplaced, bad minibatch arguments.
  FailedPrecondition  valid request, wrong buffer state: policy version older (stale, counted) or newer
                      than the buffer's; cells already pushed for this version (a double push is a
                      state conflict, not a malformed request); minibatches on an incomplete rollout;
                      finish_rollout to a version that is not newer.
A rejected push changes no byte of the buffer: everything is validated before anything is written.

Thread safety: push, finish_rollout and the GAE/advance steps of minibatches hold one lock, so
concurrent gRPC handler threads can share a buffer.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from replayd.server.buffers.lifetime import Lifetime, LiveBuffer
from replayd.server.buffers.ring import shm_name
from replayd.server.gae import GaeWorkspace, compute_gae
from replayd.server.schema import MAX_FIELDS, check_buffer_name, check_field_name, check_shape
from replayd.server.storage.shared_arrays import ArraySpec, SharedArrays
from replayd.wire.codec import CodecError, check_dtype
from replayd.wire.errors import FailedPrecondition, InvalidArgument


@dataclass(frozen=True)
class RolloutField:
    """A per-(step, env) column: `shape` is one cell's shape (() for scalars)."""

    name: str
    dtype: str
    shape: tuple[int, ...] = ()


# Inputs GAE needs for every (step, env) cell; added to the config when the user does not list them.
REQUIRED_FIELDS = (
    RolloutField("reward", "float32"),
    RolloutField("value", "float32"),  # V(s_t)
    RolloutField("terminated", "bool"),
    RolloutField("truncated", "bool"),
    RolloutField("final_value", "float32"),  # V(final observation) at truncated steps, ignored elsewhere
)
COMPUTED_FIELDS = ("advantage", "return")
# Private arrays in the segment next to the columns.
_BOOTSTRAP = "_bootstrap_value"  # (N,) V(s_T)
_FILLED = "_filled"  # (T, N) bool: cell pushed for the current policy version


@dataclass(frozen=True)
class RolloutConfig:
    fields: tuple[RolloutField, ...]
    num_steps: int
    num_envs: int
    gamma: float = 0.99
    gae_lambda: float = 0.95
    # Every column, required ones included, in storage order; filled in by __post_init__.
    columns: tuple[RolloutField, ...] = field(init=False)

    def __post_init__(self) -> None:
        for name, size in (("num_steps", self.num_steps), ("num_envs", self.num_envs)):
            if not isinstance(size, int) or size < 1:
                raise InvalidArgument(f"rollout config {name}: expected an integer >= 1, got {size!r}")
        for name, x in (("gamma", self.gamma), ("gae_lambda", self.gae_lambda)):
            if not 0.0 <= x <= 1.0:
                raise InvalidArgument(f"rollout config {name}: expected a value in [0, 1], got {x!r}")
        if len(self.fields) > MAX_FIELDS:
            raise InvalidArgument(f"rollout config fields: {len(self.fields)} fields, expected <= {MAX_FIELDS}")
        given = {}
        for spec in self.fields:
            if spec.name in COMPUTED_FIELDS or spec.name.startswith("_") or not spec.name:
                raise InvalidArgument(
                    f"rollout field {spec.name!r}: name is reserved (computed columns {COMPUTED_FIELDS},"
                    " private names start with '_')"
                )
            check_field_name(spec.name)
            if spec.name in given:
                raise InvalidArgument(f"rollout field {spec.name!r}: listed twice")
            try:
                dtype = check_dtype(spec.name, spec.dtype).name
            except CodecError as exc:
                raise InvalidArgument(str(exc)) from exc
            shape = tuple(spec.shape)
            if any(not isinstance(d, int) or d < 1 for d in shape):
                raise InvalidArgument(f"rollout field {spec.name!r}: expected positive int dims, got {shape}")
            check_shape(spec.name, dtype, shape)
            given[spec.name] = RolloutField(spec.name, dtype, shape)
        for required in REQUIRED_FIELDS:
            got = given.setdefault(required.name, required)
            if got != required:
                raise InvalidArgument(
                    f"rollout field {required.name!r}: expected dtype {required.dtype} shape"
                    f" {required.shape}, got dtype {got.dtype} shape {got.shape}"
                )
        object.__setattr__(self, "columns", tuple(given.values()))


def missing_ranges(filled: np.ndarray) -> list[dict[str, Any]]:
    """Compact description of the unfilled cells of a (T, N) mask.

    Consecutive envs with the same gaps are grouped: [{"env_start", "env_stop", "step_ranges":
    [(start, stop), ...]}], half-open ranges. Pushes are rectangles, so there are few groups.
    """
    N = filled.shape[1]
    # Env-group boundaries: where a column differs from its left neighbour.
    boundaries = np.flatnonzero(np.any(filled[:, 1:] != filled[:, :-1], axis=0)) + 1
    starts = np.concatenate([[0], boundaries])
    stops = np.concatenate([boundaries, [N]])
    groups = []
    for env_start, env_stop in zip(starts.tolist(), stops.tolist(), strict=True):
        missing = ~filled[:, env_start]  # (T,)
        if not missing.any():
            continue
        edges = np.flatnonzero(np.diff(np.concatenate([[False], missing, [False]]).astype(np.int8)))
        ranges = [(int(a), int(b)) for a, b in zip(edges[::2], edges[1::2], strict=True)]
        groups.append({"env_start": env_start, "env_stop": env_stop, "step_ranges": ranges})
    return groups


def _describe_missing(filled: np.ndarray, limit: int = 4) -> str:
    groups = missing_ranges(filled)
    parts = [f"envs [{g['env_start']}, {g['env_stop']}) steps {g['step_ranges']}" for g in groups[:limit]]
    if len(groups) > limit:
        parts.append(f"... {len(groups) - limit} more env groups")
    return "; ".join(parts)


class RolloutBuffer(LiveBuffer):
    """A (T, N) rollout in shared memory with GAE advantages and returns computed in place."""

    def __init__(self, name: str, shared: SharedArrays, config: RolloutConfig, policy_version: int) -> None:
        self.name = name
        self.config = config
        self.shared = shared
        self.columns = {spec.name: shared.arrays[spec.name] for spec in config.columns}  # (T, N, ...)
        self.advantage = shared.arrays["advantage"]  # (T, N) float32
        self.returns = shared.arrays["return"]  # (T, N) float32
        self._bootstrap = shared.arrays[_BOOTSTRAP]  # (N,) float32
        self._filled = shared.arrays[_FILLED]  # (T, N) bool
        self._workspace = GaeWorkspace(config.num_steps, config.num_envs)
        self._lock = threading.Lock()
        self.lifetime = Lifetime(self._lock, name)  # every use of the arrays enters it (live())
        self._version = policy_version
        self._missing = config.num_steps * config.num_envs
        self._gae_done = False
        self.counters = {
            "pushes": 0,
            "pushed_steps": 0,
            "stale_pushes": 0,
            "rejected_pushes": 0,
            "minibatches_served": 0,
            "served_samples": 0,  # rows of the minibatches served (the status page's samples/s)
            "rollouts_finished": 0,
            "gae_computations": 0,
        }

    @classmethod
    def create(cls, name: str, instance: str, config: RolloutConfig, policy_version: int = 0,
               max_bytes: int | None = None) -> RolloutBuffer:
        """Allocates every column once, in shared memory named after the server instance and the buffer.
        More than `max_bytes` (or the free shared memory) is refused with ResourceExhausted."""
        check_buffer_name(name)
        T, N = config.num_steps, config.num_envs
        specs = [ArraySpec(s.name, s.dtype, (T, N, *s.shape)) for s in config.columns]
        specs += [ArraySpec(name, "float32", (T, N)) for name in COMPUTED_FIELDS]
        specs += [ArraySpec(_BOOTSTRAP, "float32", (N,)), ArraySpec(_FILLED, "bool", (T, N))]
        meta = {"kind": "rollout", "num_steps": T, "num_envs": N, "gamma": config.gamma,
                "gae_lambda": config.gae_lambda}
        return cls(name, SharedArrays.create(shm_name(instance, name), specs, meta, max_bytes), config,
                   policy_version)

    @property
    def cell_bytes(self) -> int:
        """Bytes one (step, env) cell holds across every column (what a push stores per step and env)."""
        return sum(np.dtype(spec.dtype).itemsize * math.prod(spec.shape) for spec in self.config.columns)

    @property
    def sample_bytes(self) -> int:
        """Bytes of one sample of a minibatch: every column's cell, and advantage and return (float32)."""
        return self.cell_bytes + len(COMPUTED_FIELDS) * 4

    @property
    def policy_version(self) -> int:
        return self._version

    @property
    def missing_steps(self) -> int:
        return self._missing

    @property
    def rollout_complete(self) -> bool:
        return self._missing == 0

    def missing_ranges(self) -> list[dict[str, Any]]:
        """Which (step, env) cells are still missing for the current version (see `missing_ranges`)."""
        with self.live():
            return missing_ranges(self._filled)

    def push(
        self,
        policy_version: int,
        env_start: int,
        step_start: int,
        columns: Mapping[str, np.ndarray],
        bootstrap_value: np.ndarray | None = None,
    ) -> dict[str, Any]:
        """Writes a (steps, envs) part into [step_start, +steps) x [env_start, +envs).

        `columns` holds every config column shaped (steps, envs, *cell_shape) with the exact dtype.
        `bootstrap_value` (envs,) float32 is V(s_T) and is required exactly when the part reaches the
        last step. Returns {"missing_steps", "rollout_complete"} after the write.
        """
        with self.live():
            try:
                steps, envs = self._validate_push(
                    policy_version, env_start, step_start, columns, bootstrap_value
                )
            except (FailedPrecondition, InvalidArgument):
                self.counters["rejected_pushes"] += 1
                raise
            cells = (slice(step_start, step_start + steps), slice(env_start, env_start + envs))
            for name, target in self.columns.items():
                target[cells] = columns[name]
            if bootstrap_value is not None:
                self._bootstrap[cells[1]] = bootstrap_value
            self._filled[cells] = True
            self._missing -= steps * envs
            self.counters["pushes"] += 1
            self.counters["pushed_steps"] += steps * envs
            return {"missing_steps": self._missing, "rollout_complete": self._missing == 0}

    def _validate_push(
        self,
        policy_version: int,
        env_start: int,
        step_start: int,
        columns: Mapping[str, np.ndarray],
        bootstrap_value: np.ndarray | None,
    ) -> tuple[int, int]:
        """(steps, envs) of a push every check passes; raises naming the first field that fails one."""
        self._check_version(policy_version)
        steps, envs = self._check_columns(columns)
        self._check_cells(steps, envs, step_start, env_start)
        self._check_bootstrap(bootstrap_value, steps, envs, step_start)
        overlap = self._filled[step_start : step_start + steps, env_start : env_start + envs]
        if overlap.any():
            t, e = np.argwhere(overlap)[0]
            raise FailedPrecondition(
                f"cells: expected unpushed cells for policy_version {self._version}, got {int(overlap.sum())}"
                f" already pushed (first: step {step_start + t}, env {env_start + e})"
            )
        return steps, envs

    def _check_version(self, policy_version: int) -> None:
        if policy_version < self._version:
            self.counters["stale_pushes"] += 1
            raise FailedPrecondition(
                f"policy_version: expected {self._version} (the current rollout), got stale {policy_version}"
            )
        if policy_version > self._version:
            raise FailedPrecondition(
                f"policy_version: expected {self._version}, got {policy_version}: the learner has not"
                " finished the current rollout (finish_rollout) yet"
            )

    def _check_columns(self, columns: Mapping[str, np.ndarray]) -> tuple[int, int]:
        """The (steps, envs) every column shares, each of its field's dtype and cell shape."""
        expected = {spec.name: spec for spec in self.config.columns}
        unknown = sorted(set(columns) - set(expected))
        if unknown:
            raise InvalidArgument(
                f"field {unknown[0]!r}: not a column of this buffer (expected {sorted(expected)})"
            )
        absent = [name for name in expected if name not in columns]
        if absent:
            raise InvalidArgument(f"field {absent[0]!r}: missing from the push (expected {sorted(expected)})")
        steps = envs = None
        for name, spec in expected.items():
            array = columns[name]
            if not isinstance(array, np.ndarray):
                raise InvalidArgument(f"field {name!r}: expected a numpy array, got {type(array).__name__}")
            if array.dtype != np.dtype(spec.dtype):
                raise InvalidArgument(f"field {name!r}: expected dtype {spec.dtype}, got {array.dtype}")
            if steps is None and array.ndim >= 2:
                steps, envs = array.shape[:2]
            if array.shape != (steps, envs, *spec.shape):
                raise InvalidArgument(
                    f"field {name!r}: expected shape (steps, envs, *{spec.shape}) = "
                    f"{(steps, envs, *spec.shape)}, got {array.shape}"
                )
        for name in ("reward", "value", "final_value"):  # one NaN would poison GAE back to the episode start
            finite = np.isfinite(columns[name])
            if not finite.all():
                t, e = np.argwhere(~finite)[0]
                raise InvalidArgument(f"field {name!r}: expected finite values, got {float(columns[name][t, e])} "
                                      f"at (step {t}, env {e}) of the part")
        return steps, envs

    def _check_cells(self, steps: int, envs: int, step_start: int, env_start: int) -> None:
        T, N = self.config.num_steps, self.config.num_envs
        if steps < 1 or envs < 1:
            raise InvalidArgument(f"push: expected >= 1 step and env, got (steps, envs) = {(steps, envs)}")
        if steps > T:
            raise InvalidArgument(f"push: expected <= {T} steps (the buffer's num_steps), got {steps}")
        if envs > N:
            raise InvalidArgument(f"num_envs: expected <= {N} (the buffer's env slots), got {envs}")
        if not 0 <= step_start <= T - steps:
            raise InvalidArgument(
                f"step_start: expected 0 <= step_start <= {T} - {steps} (the part's steps), got {step_start}"
            )
        if not 0 <= env_start <= N - envs:
            raise InvalidArgument(
                f"env_start: expected 0 <= env_start <= {N} - {envs} (the part's envs), got {env_start}"
            )

    def _check_bootstrap(self, bootstrap_value: np.ndarray | None, steps: int, envs: int, step_start: int) -> None:
        T = self.config.num_steps
        if step_start + steps < T:
            if bootstrap_value is not None:
                raise InvalidArgument(
                    f"bootstrap_value: only valid in a part reaching the last step {T - 1}, this part ends at"
                    f" step {step_start + steps - 1}"
                )
            return
        if bootstrap_value is None:
            raise InvalidArgument(f"bootstrap_value: required when a part reaches the last step {T - 1}")
        if not isinstance(bootstrap_value, np.ndarray) or bootstrap_value.dtype != np.float32:
            got = getattr(bootstrap_value, "dtype", type(bootstrap_value).__name__)
            raise InvalidArgument(f"bootstrap_value: expected dtype float32, got {got}")
        if bootstrap_value.shape != (envs,):
            raise InvalidArgument(
                f"bootstrap_value: expected shape {(envs,)}, got {bootstrap_value.shape}"
            )
        finite = np.isfinite(bootstrap_value)
        if not finite.all():
            e = int(np.argmin(finite))
            raise InvalidArgument(f"bootstrap_value: expected finite values, got {float(bootstrap_value[e])} "
                                  f"at env {e} of the part")

    def finish_rollout(self, next_version: int) -> None:
        """Starts the next rollout under `next_version` (> current); the arrays are reused as they are."""
        with self.live():
            if next_version <= self._version:
                raise FailedPrecondition(
                    f"next_version: expected a version > {self._version}, got {next_version}"
                )
            self._filled.fill(False)
            self._missing = self.config.num_steps * self.config.num_envs
            self._version = next_version
            self._gae_done = False
            self.counters["rollouts_finished"] += 1

    def compute_advantages(self) -> int:
        """Runs GAE into the advantage/return columns once per complete rollout; returns its policy version
        (read under the same lock: a finish_rollout right after must not pass for this rollout).

        Lazily, from the first minibatch request rather than from the push that completes the
        rollout: that push is on an actor's critical path, while the learner is waiting either way.
        """
        with self.live():
            self._require_complete()
            if self._gae_done:
                return self._version
            c = self.columns
            compute_gae(
                c["reward"], c["value"], c["terminated"], c["truncated"], c["final_value"], self._bootstrap,
                self.config.gamma, self.config.gae_lambda, self.advantage, self.returns, self._workspace,
            )
            self._gae_done = True
            self.counters["gae_computations"] += 1
            return self._version

    def _require_complete(self) -> None:
        if self._missing:
            raise FailedPrecondition(
                f"rollout: expected complete for policy_version {self._version}, got {self._missing} missing"
                f" (step, env) cells: {_describe_missing(self._filled)}"
            )

    def minibatches(
        self,
        minibatch_size: int,
        epochs: int = 1,
        normalize_advantages: bool = True,
        drop_last: bool = False,
        seed: int | None = None,
    ) -> Iterator[dict[str, np.ndarray]]:
        """Shuffled minibatches of the T·N samples: a fresh permutation per epoch, cut into `minibatch_size`.

        Each minibatch maps every column (flattened to (M, *cell_shape), time-major) plus `advantage`
        and `return` to fresh arrays. Arguments and completeness are checked now, not on first next().
        Iterating after finish_rollout raises FailedPrecondition rather than mixing two rollouts.
        """
        total = self.config.num_steps * self.config.num_envs
        if not 1 <= minibatch_size <= total:
            raise InvalidArgument(f"minibatch_size: expected 1..{total} (T·N samples), got {minibatch_size}")
        if epochs < 1:
            raise InvalidArgument(f"epochs: expected >= 1, got {epochs}")
        version = self.compute_advantages()
        return self._minibatches(minibatch_size, epochs, normalize_advantages, drop_last, seed, version)

    def _minibatches(
        self, size: int, epochs: int, normalize: bool, drop_last: bool, seed: int | None, version: int
    ) -> Iterator[dict[str, np.ndarray]]:
        total = self.config.num_steps * self.config.num_envs
        flat = {name: a.reshape(total, *a.shape[2:]) for name, a in self.columns.items()}  # (T·N, ...) views
        flat["advantage"] = self.advantage.reshape(total)
        flat["return"] = self.returns.reshape(total)
        rng = np.random.default_rng(seed)
        stop = total - total % size if drop_last else total
        for _ in range(epochs):
            order = rng.permutation(total)
            for start in range(0, stop, size):
                index = order[start : start + size]  # (M,)
                with self.live():
                    if self._version != version:
                        raise FailedPrecondition(
                            f"policy_version: minibatches were for {version}, the buffer moved on to"
                            f" {self._version}"
                        )
                    batch = {name: np.take(a, index, axis=0) for name, a in flat.items()}
                    self.counters["minibatches_served"] += 1
                    self.counters["served_samples"] += len(index)
                if normalize:
                    batch["advantage"] = _normalize(batch["advantage"])
                yield batch

    def snapshot(self) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """Copies of every shared array and the state kept outside them, taken together under the lock."""
        with self.live():
            arrays = {name: array.copy() for name, array in self.shared.arrays.items()}
            state = {"policy_version": self._version, "missing": self._missing, "gae_done": self._gae_done,
                     "counters": dict(self.counters)}
        return arrays, state

    def restore_state(self, state: dict[str, Any]) -> None:
        """The counterpart of `snapshot` for a buffer created at the snapshot's policy version."""
        with self.live():
            self._missing = int(state["missing"])
            self._gae_done = bool(state["gae_done"])
            self.counters.update(state["counters"])

    def info(self) -> dict[str, Any]:
        with self.live():
            return {
                "kind": "rollout",
                "shm_name": self.shared.header_name,
                "bytes": self.shared.nbytes,
                "num_steps": self.config.num_steps,
                "num_envs": self.config.num_envs,
                "policy_version": self._version,
                "missing_steps": self._missing,
                "rollout_complete": self._missing == 0,
                "missing_ranges": missing_ranges(self._filled)[:16],
                "counters": dict(self.counters),
            }

    def close(self, unlink: bool = True) -> None:
        """Waits for the call holding the lock (a push, a minibatch gather) and unmaps the arrays."""

        def release() -> None:
            self.columns.clear()
            self.shared.close()
            if unlink:
                self.shared.unlink()

        self.lifetime.end(release)

    def unlink(self) -> None:
        self.shared.unlink()


def _normalize(advantage: np.ndarray) -> np.ndarray:
    """(a − mean) / (std + 1e-8) per minibatch; unbiased std as in CleanRL's torch `.std()`."""
    a64 = advantage.astype(np.float64)
    std = a64.std(ddof=1) if a64.size > 1 else 0.0  # one sample: std 0, normalizes to 0
    return ((a64 - a64.mean()) / (std + 1e-8)).astype(np.float32)
