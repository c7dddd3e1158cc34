"""Learners: create the buffer, train from replayd, publish weights, write a run folder.

`python -m replayd.client.learner --algo {dqn,ppo,allo,drqn,her} --address HOST:PORT` (or `replayd learn ...`):
a progress bar over the training budget while it runs, one summary line at the end. Implementations live in
client/learners/.
"""

from __future__ import annotations

import argparse

import torch

from replayd.client.algos import (
    ALGOS,
    add_common_options,
    at_least,
    build,
    refuse_compile_loss_off_cpu,
    refuse_foreign_options,
)
from replayd.client.heartbeat import Heartbeat
from replayd.client.learners.common import BufferMismatch, Progress, write_run
from replayd.client.learners.dqn import CARTPOLE_SCHEMA, DQNLearnerConfig, learn_dqn
from replayd.client.progress_bar import ProgressBar
from replayd.client.sharded import connect

__all__ = ["CARTPOLE_SCHEMA", "DQNLearnerConfig", "Progress", "learn_dqn", "main", "write_run"]


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    """`prog`: the command as the user typed it, for usage lines (`replayd learn`)."""
    parser = argparse.ArgumentParser(prog=prog, description="replayd learner")
    add_common_options(parser)
    parser.add_argument("--address", required=True,
                        help="host:port of the replay server; shards:NAME:PORT (every server NAME resolves to) or "
                             "host:port,host:port,... for several, ray:NAME for Ray shards "
                             "(replayd.client.sharded.connect)")
    parser.add_argument("--run-dir")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--eval-every", type=at_least(1),
                        help="dqn/drqn/her/allo: learner steps, ppo: versions between evaluations")
    parser.add_argument("--learning-starts", type=at_least(0),
                        help="dqn/drqn/her/allo: sampleable steps before training")
    parser.add_argument("--actors", type=at_least(1), help="ppo: number of actors (rollout slots = actors * envs)")
    parser.add_argument("--local", action="store_true", default=None,
                        help="dqn: sample the server's shared memory directly (the server runs on this host)")
    parser.add_argument("--compile-loss", action="store_true", default=None,
                        help="dqn: compile the Q-loss ahead with inductor (CPU; needs a C++ compiler; "
                        "a 1.4-1.9x faster loss step)")
    parser.add_argument("--heartbeat", metavar="FILE",
                        help="touch FILE at every report (at least once a second, training or waiting for data), for a "
                             "liveness probe (python -m replayd.client.heartbeat FILE --max-age SECONDS)")
    args = vars(parser.parse_args(argv))
    heartbeat_file = args.pop("heartbeat")
    algo_name = args.pop("algo")
    algo = ALGOS[algo_name]
    refuse_foreign_options(parser, algo_name, args, (algo.learner_config,))
    refuse_compile_loss_off_cpu(parser, args)
    torch.set_num_threads(1)
    config = build(algo.learner_config, **args)
    heartbeat = Heartbeat(heartbeat_file)
    with connect(config.address) as monitor:  # one server or the shards, as the learner itself connects
        bar = ProgressBar(monitor, config.buffer, algo.counters, algo.score_label, config.seconds)

        def finished(summary: dict) -> None:
            """The summary line, printed before the final weights stop the actors (see finish_learner)."""
            bar.close()
            print(bar.summary_line(summary), flush=True)

        def report(progress: Progress) -> None:
            heartbeat.beat()
            bar(progress)

        try:
            algo.learn(config, report=report, finished=finished)
        except BufferMismatch as exc:
            parser.exit(1, f"{parser.prog}: {exc}\n")
        finally:
            bar.close()


if __name__ == "__main__":
    main()
