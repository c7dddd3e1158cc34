"""Actors: step environments and push experience into a replayd server.

`python -m replayd.client.actor --algo {dqn,ppo,allo,drqn,her} --address HOST:PORT` (or `replayd actor ...`).
dqn: epsilon-greedy CartPole episodes with the newest Q-network; ppo: one rollout part per policy
version (`--actor-index` picks the slots; the learner's `--actors` says how many there are); allo:
random-walk episodes in four rooms; drqn: epsilon-greedy CartPole-without-velocities episodes with the newest
recurrent Q-network, its state stored per step; her: epsilon-greedy 15-bit-flipping episodes with the newest
goal-conditioned Q-network. Implementations live in client/actors/.
"""

from __future__ import annotations

import argparse
import secrets
import signal
import threading

from replayd.client.actors.common import ActorReport, flush_with_retry, refresh_weights, wait_for_buffer
from replayd.client.actors.dqn import DQNActorConfig, run_dqn_actor
from replayd.client.algos import ALGOS, add_common_options, at_least, build, refuse_foreign_options
from replayd.client.heartbeat import BeatingStop, Heartbeat

__all__ = ["ActorReport", "DQNActorConfig", "flush_with_retry", "main", "refresh_weights", "run_dqn_actor",
           "wait_for_buffer"]


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    """`prog`: the command as the user typed it, for usage lines (`replayd actor`)."""
    parser = argparse.ArgumentParser(prog=prog, description="replayd actor")
    add_common_options(parser)
    parser.add_argument("--address", required=True,
                        help="host:port of the replay server; shards:NAME:PORT (every server NAME resolves to) or "
                             "host:port,host:port,... for several, ray:NAME for Ray shards "
                             "(replayd.client.sharded.connect)")
    parser.add_argument("--buffer")
    parser.add_argument("--env", dest="env_id")
    parser.add_argument("--seed", type=int)
    parser.add_argument("--actor-index", type=at_least(0), help="ppo: this actor's slot block (0 .. actors - 1)")
    parser.add_argument("--heartbeat", metavar="FILE",
                        help="touch FILE at every step and every poll while waiting, for a liveness probe "
                             "(python -m replayd.client.heartbeat FILE --max-age SECONDS)")
    args = vars(parser.parse_args(argv))
    heartbeat_file = args.pop("heartbeat")
    algo_name = args.pop("algo")
    algo = ALGOS[algo_name]
    refuse_foreign_options(parser, algo_name, args, (algo.actor_config,))
    heartbeat = Heartbeat(heartbeat_file)
    if args["seconds"] is None:
        args["seconds"] = 3600.0
    if args["seed"] is None and algo_name != "ppo":  # ppo actors seed from their --actor-index
        # Actors started alike (one command line each, compose's --scale) must not write the same episodes.
        args["seed"] = secrets.randbits(31)
        print(f"actor: seed {args['seed']} (--seed fixes it)", flush=True)
    # SIGTERM (docker stop, compose down) ends the actor as its time budget does: the step in progress
    # finishes and the episodes written are flushed to the server. Python's default would let the process
    # die with them (and, as a container's PID 1, not stop at all until Docker killed it).
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    report = algo.actor(build(algo.actor_config, **args), BeatingStop(stop, heartbeat))
    print(f"actor: {report.env_steps} env steps, weights version {report.weights_version}, "
          f"{report.pushed} pushed", flush=True)


if __name__ == "__main__":
    main()
