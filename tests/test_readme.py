"""The README's "Using it" examples run as written against a live server.

The test changes only what a reader supplies: the server's address, the arrays the snippets take as given
(obs, action, reward for an episode; o, a, r, final_obs for a step), episodes in the learner's buffer
before it samples (actors would have written them), and a `break` that ends each endless loop after its
first batch. A README edit that breaks an example, or moves what these edits expect, fails here.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from service.server import ReplayServer

README = Path(__file__).resolve().parents[1] / "README.md"


def using_it_snippets() -> list[str]:
    text = README.read_text()
    section = text[text.index("\n## Using it\n"):text.index("\n## Architecture\n")]
    return re.findall(r"```python\n(.*?)```", section, re.S)


def edited(snippet: str, old: str, new: str) -> str:
    assert snippet.count(old) == 1, f"the README example no longer has exactly one {old!r}"
    return snippet.replace(old, new)


def test_the_using_it_examples_run(server: ReplayServer) -> None:
    actor_side, learner_side = using_it_snippets()
    actor_side = edited(actor_side, '"127.0.0.1:50051"', repr(server.address))
    actor_side = edited(actor_side, "\n    ...\n", "\n    streamed = batch\n    break\n")
    learner_side = edited(learner_side, "\ntrainer = DQNTrainer(",
                          '\nrc.insert_episode("cartpole", terminated=True, **cartpole_episode)\ntrainer = DQNTrainer(')
    learner_side = edited(learner_side, "+ 1e-3)\n", "+ 1e-3)\n    break\n")

    rng = np.random.default_rng(0)
    steps = 10
    namespace = {
        "obs": rng.integers(0, 256, (steps + 1, 84, 84), dtype=np.uint8),  # one frame per state
        "action": rng.integers(0, 4, steps),
        "reward": rng.random(steps, dtype=np.float32),
        "o": rng.integers(0, 256, (4, 84, 84), dtype=np.uint8),  # a frame-stacking wrapper's observation
        "a": 1,
        "r": 0.5,
        "final_obs": rng.integers(0, 256, (84, 84), dtype=np.uint8),
        "cartpole_episode": {"obs": rng.random((21, 4), dtype=np.float32), "action": rng.integers(0, 2, 20),
                             "reward": np.ones(20, dtype=np.float32)},
    }
    try:
        exec(compile(actor_side, "README: Using it", "exec"), namespace)
        batch, pairs, streamed = namespace["batch"], namespace["pairs"], namespace["streamed"]
        assert batch["obs"].shape == (32, 4, 84, 84)  # the frames stacked at sample time
        assert batch["bootstrap_obs"].shape == (32, 4, 84, 84)
        assert pairs["future_obs"].shape == (256, 4, 84, 84)
        assert (pairs["offset"] >= 1).all()
        assert streamed["next_obs"].shape == (32, 4, 84, 84)
        # the writer's one-step episode landed beside the inserted one
        assert namespace["rc"].describe("atari")["episodes"] == 2

        exec(compile(learner_side, "README: the learner", "exec"), namespace)
        assert namespace["out"]["td_error"].shape == (256,)
    finally:
        if "rc" in namespace:
            namespace["rc"].close()
