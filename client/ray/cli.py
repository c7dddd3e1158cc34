"""`replayd ray up|down|status|run`: replay shards and the actor and learner programs on a Ray cluster, from a
shell on one of its nodes or as a Ray job:

    ray job submit -- replayd ray up --shards 3 --strategy STRICT_SPREAD --checkpoint-dir /mnt/shared/replayd
    ray job submit -- replayd ray run --algo dqn --actors 4 --seconds 600
    ray job submit -- replayd ray down

`up` starts detached shards (they outlive the command and its job) and prints where they listen; actors and
learners anywhere on the cluster reach them as `--address ray:NAME`. `run` starts the programs as Ray tasks and waits
for the learner's summary. `down` stops the shards and unlinks their shared memory.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from replayd.client.ray import STRATEGIES, require_ray


def _add_cluster_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--name", default="replayd", help="the shards' name (default replayd): clients use ray:NAME")
    parser.add_argument("--address", default="auto",
                        help="the Ray cluster (default: $RAY_ADDRESS, else the one running on this node)")


def _up(args: argparse.Namespace) -> None:
    from replayd.client.ray.shards import start_shards

    started = start_shards(
        args.shards, name=args.name, strategy=args.strategy, cpus_per_shard=args.cpus_per_shard,
        shm_bytes=None if args.shm_gb is None else int(args.shm_gb * 2**30), checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every, checkpoint_keep=args.checkpoint_keep, detached=True,
        max_restarts=args.max_restarts, port=args.port, http_port=args.http_port, host=args.host,
        token=args.token or None, insecure_bind_all=args.insecure_bind_all, timeout=args.timeout)
    _print_status(started.info())
    print(f"{args.shards} shard(s) {args.name!r} up; actors and learners: --address ray:{args.name}; "
          f"stop them with `replayd ray down --name {args.name}`", flush=True)


def _print_status(infos: list[dict]) -> None:
    for info in infos:
        http = "" if info["http_port"] is None else f", status page on port {info['http_port']}"
        print(f"shard {info['index']}: {info['address']} (node {info['node_id'][:12]}, instance {info['instance']}, "
              f"{info['started_from']}{', restarted by Ray' if info['restarted'] else ''}{http})", flush=True)


def _run(args: argparse.Namespace) -> None:
    from replayd.client.ray.jobs import run_actors

    learner_options = {"seconds": args.seconds, **({"run_dir": args.run_dir} if args.run_dir else {})}
    run = run_actors(args.name, args.algo, args.actors, actor_options={"seconds": args.seconds + 600},
                     learner_options=learner_options, cpus_per_actor=args.cpus_per_actor,
                     cpus_per_learner=args.cpus_per_learner)
    try:
        summary, reports = run.result()
    except BaseException:
        run.cancel()
        raise
    from replayd.client.algos import ALGOS

    steps = sum(report.env_steps for report in reports)
    shown = {key: summary.get(key) for key in ("seconds", "learner_steps", "env_steps", ALGOS[args.algo].score)}
    print(f"learner: {json.dumps(shown)}; {len(reports)} actor(s): {steps} env steps", flush=True)


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    parser = argparse.ArgumentParser(prog=prog or "replayd ray", description="replayd on a Ray cluster")
    commands = parser.add_subparsers(dest="command", required=True)
    up = commands.add_parser("up", help="start replay shards as detached Ray actors")
    _add_cluster_options(up)
    up.add_argument("--shards", type=int, required=True, help="how many replay servers")
    up.add_argument("--strategy", choices=STRATEGIES, default="SPREAD",
                    help="placement group strategy (STRICT_SPREAD: never two shards on one node)")
    up.add_argument("--cpus-per-shard", type=float, default=1.0)
    up.add_argument("--shm-gb", type=float, default=None,
                    help="/dev/shm each shard reserves, as the node resource `shm` in bytes that every node declares "
                         "(ray start --resources='{\"shm\": BYTES}'); none by default")
    up.add_argument("--checkpoint-dir", default=None,
                    help="storage every node reaches: each shard checkpoints into DIR/NAME/shard-K, and one that Ray "
                         "restarts on another node restores its latest checkpoint")
    up.add_argument("--checkpoint-every", type=float, default=None, metavar="SECONDS")
    up.add_argument("--checkpoint-keep", type=int, default=3)
    up.add_argument("--max-restarts", type=int, default=-1, help="Ray's restarts of each shard (-1: always)")
    up.add_argument("--port", type=int, default=0, help="gRPC port (0: a free one; fixed needs STRICT_SPREAD)")
    up.add_argument("--http-port", type=int, default=0, help="status page port (0: a free one, -1: none)")
    up.add_argument("--host", default=None, help="bind address (default: the node's IP address)")
    up.add_argument("--token", default=os.environ.get("REPLAYD_TOKEN", ""),
                    help="bearer token the servers require (default $REPLAYD_TOKEN); a non-loopback bind needs one "
                         "or --insecure-bind-all")
    up.add_argument("--insecure-bind-all", action="store_true")
    up.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for placement and start")
    down = commands.add_parser("down", help="stop the shards and unlink their shared memory")
    _add_cluster_options(down)
    status = commands.add_parser("status", help="where each shard listens, on which node, and how it started")
    _add_cluster_options(status)
    run = commands.add_parser("run", help="run the actor and learner programs as Ray tasks against the shards")
    _add_cluster_options(run)
    run.add_argument("--algo", default="dqn", help="an algorithm `replayd learn --algo` takes (default dqn)")
    run.add_argument("--actors", type=int, default=2)
    run.add_argument("--seconds", type=float, default=300.0, help="the learner's training budget")
    run.add_argument("--run-dir", default=None, help="the learner's run folder (on the learner's node)")
    run.add_argument("--cpus-per-actor", type=float, default=1.0)
    run.add_argument("--cpus-per-learner", type=float, default=1.0)
    args = parser.parse_args(argv)
    try:
        require_ray()
    except ImportError as exc:
        parser.exit(1, f"{parser.prog}: {exc}\n")
    import ray

    from replayd.client.ray.resolver import NAMESPACE

    ray.init(address=args.address, namespace=NAMESPACE, log_to_driver=False)
    try:
        _COMMANDS[args.command](args)
    except (ValueError, TimeoutError) as exc:
        parser.exit(1, f"{parser.prog} {args.command}: {exc}\n")
    finally:
        ray.shutdown()


def _down(args: argparse.Namespace) -> None:
    from replayd.client.ray.shards import find_shards

    found = find_shards(args.name)
    found.stop()
    print(f"{len(found.handles)} shard(s) {args.name!r} stopped; their shared memory is unlinked", flush=True)


def _status(args: argparse.Namespace) -> None:
    from replayd.client.ray.shards import find_shards

    _print_status(find_shards(args.name).info())


_COMMANDS: dict[str, Any] = {"up": _up, "down": _down, "status": _status, "run": _run}
