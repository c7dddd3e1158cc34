"""The algorithms the actor, learner and demo command lines know: which actor and learner functions
run them, how their configs are built from options, and how a progress bar shows their progress."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any, TypeVar

from replayd.client.actors.allo import AlloActorConfig, run_allo_actor
from replayd.client.actors.dqn import DQNActorConfig, run_dqn_actor
from replayd.client.actors.drqn import DRQNActorConfig, run_drqn_actor
from replayd.client.actors.her import HERActorConfig, run_her_actor
from replayd.client.actors.ppo import PPOActorConfig, run_ppo_actor
from replayd.client.envs import CARTPOLE_POMDP
from replayd.client.learners.allo import AlloLearnerConfig, learn_allo
from replayd.client.learners.dqn import DQNLearnerConfig, learn_dqn
from replayd.client.learners.drqn import DRQNLearnerConfig, learn_drqn
from replayd.client.learners.her import HERLearnerConfig, learn_her
from replayd.client.learners.ppo import PPOLearnerConfig, learn_ppo

C = TypeVar("C")


@dataclass(frozen=True)
class Baseline:
    """What the demo trains after an algorithm, on the same task with the same budget, to compare with: the
    algorithm `algo` (an ALGOS name) with its learner's and actors' config values `options` (its own buffer
    and weights names, the task's env), named `label` in the curve's legend and the summary."""

    algo: str
    label: str
    options: dict[str, Any]


@dataclass(frozen=True)
class Algo:
    actor: Callable[..., Any]  # run_*_actor(config, stop=None) -> ActorReport
    actor_config: type
    learn: Callable[..., dict]  # learn_*(config, report, waiting, finished) -> summary
    learner_config: type
    score: str  # the summary's final score
    score_label: str
    counters: tuple[str, str]  # buffer counters of steps in and items out: the progress bar's rates and ratio
    outputs: tuple[str, ...] = ("learning_curve.png", "summary.json")
    curve: str = "eval_return"  # the score's key in the summary's curve points
    target: str = "target_return"  # the summary's key of the score the learner stops at
    label: str = ""  # the algorithm's name beside its baseline's
    baseline: Baseline | None = None


ALGOS: dict[str, Algo] = {
    "dqn": Algo(run_dqn_actor, DQNActorConfig, learn_dqn, DQNLearnerConfig, "final_eval_return", "greedy return",
                ("inserted_rows", "sampled_items")),
    "ppo": Algo(run_ppo_actor, PPOActorConfig, learn_ppo, PPOLearnerConfig, "final_eval_return",
                "deterministic return", ("pushed_steps", "served_samples")),
    "allo": Algo(run_allo_actor, AlloActorConfig, learn_allo, AlloLearnerConfig, "avg_cosine", "average |cosine|",
                 ("inserted_rows", "sampled_items"), ("learning_curve.png", "summary.json", "eigenvectors.png"),
                 curve="avg_cosine", target="target_cosine"),
    "drqn": Algo(run_drqn_actor, DRQNActorConfig, learn_drqn, DRQNLearnerConfig, "final_eval_return",
                 "greedy return", ("inserted_rows", "sampled_items"), label="DRQN",
                 baseline=Baseline("dqn", "DQN (no memory)", {
                     "env_id": CARTPOLE_POMDP, "buffer": "cartpole_pomdp", "weights": "q_pomdp",
                     "target_return": DRQNLearnerConfig.target_return})),
    "her": Algo(run_her_actor, HERActorConfig, learn_her, HERLearnerConfig, "final_success_rate",
                "greedy success rate", ("inserted_rows", "sampled_items"), curve="success_rate",
                target="target_success", label="DQN + HER", baseline=Baseline("her", "DQN (no relabeling)", {
                    "relabel_ratio": 0.0, "buffer": "bit_flipping_plain", "weights": "q_bit_flipping"})),
}


def build(config_type: type[C], **values: Any) -> C:
    """A config dataclass from the given values, skipping None (keep the default) and foreign names."""
    names = {f.name for f in fields(config_type)}
    return config_type(**{k: v for k, v in values.items() if k in names and v is not None})


def refuse_foreign_options(parser: argparse.ArgumentParser, algo: str, options: dict[str, Any],
                           configs: tuple[type, ...], own: tuple[str, ...] = ()) -> None:
    """Exits with a usage error for given options (not None) that none of `configs` has and the command
    does not use itself (`own`): `build` would drop them, and `--local` with ppo would do nothing."""
    taken = {f.name for config in configs for f in fields(config)} | set(own)
    flags = {action.dest: action.option_strings[0] for action in parser._actions if action.option_strings}
    foreign = [flags.get(name, name) for name, value in options.items() if value is not None and name not in taken]
    if foreign:
        parser.error(f"--algo {algo} does not take {', '.join(foreign)}")


def refuse_compile_loss_off_cpu(parser: argparse.ArgumentParser, options: dict[str, Any]) -> None:
    """`--compile-loss` is measured and supported on the CPU only (DQNTrainer refuses it elsewhere): say so
    before any server, buffer or actor is started."""
    if options.get("compile_loss") and options["device"].split(":")[0] != "cpu":
        parser.error(f"--compile-loss runs on the CPU only, not --device {options['device']}: add --device cpu")


def seconds(text: str) -> float:
    """argparse type: a finite number > 0 (a budget of NaN never ran out, a negative one at once)."""
    value = float(text)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text}")
    return value


def at_least(minimum: int) -> Callable[[str], int]:
    """argparse type: an integer >= `minimum` (a count or period below it would be used as given, to no good)."""
    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {value}")
        return value

    parse.__name__ = "int"  # argparse names it for a non-integer: "invalid int value: '1.5'"
    return parse


def add_common_options(parser: argparse.ArgumentParser) -> None:
    """Options the actor, learner and demo command lines share (unset: the algorithm's default)."""
    parser.add_argument("--algo", choices=sorted(ALGOS), default="dqn")
    parser.add_argument("--seconds", type=seconds, help="time budget (default: the algorithm's)")
    parser.add_argument("--envs", dest="num_envs", type=at_least(1), help="ppo: environments per actor")
    parser.add_argument("--rollout-steps", type=at_least(1), help="ppo: steps per rollout (T)")
    parser.add_argument("--episodes", type=at_least(1), help="allo actors: random-walk episodes per actor")
