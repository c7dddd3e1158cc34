"""`replayd serve`: run a replay server until SIGINT/SIGTERM, then unlink its shared memory."""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import logging
import math
import os
import platform
import signal
import threading
from pathlib import Path

import replayd
from replayd.server.buffers.reader import lock_free_host
from replayd.server.schema import check_instance_name
from replayd.server.server import ReplayServer
from replayd.server.storage.instance_lock import InstanceLock
from replayd.server.storage.shared_arrays import SHM_DIR, remove_segment, segments
from replayd.server.tokens import check_bind, check_token
from replayd.wire.errors import FailedPrecondition, ReplayError


def tune_allocator() -> None:
    """Keeps insert-sized buffers (up to 32 MB) in glibc's heap: as fresh mmaps, every request's bytes
    would be page-faulted in again, which measured several times slower for large inserts. Two arenas
    instead of 8 per core keep the many gRPC threads from each holding on to their own free memory."""
    libc_name = ctypes.util.find_library("c")
    if libc_name is None:
        return
    libc = ctypes.CDLL(libc_name)
    m_trim_threshold, m_mmap_threshold, m_arena_max = -1, -3, -8
    libc.mallopt(m_mmap_threshold, 32 * 2**20)
    libc.mallopt(m_trim_threshold, 256 * 2**20)
    libc.mallopt(m_arena_max, 2)


def instance_name(text: str) -> str:
    """argparse type: an instance name the segment prefixes cannot confuse with another's."""
    try:
        return check_instance_name(text)
    except ReplayError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def worker_count(text: str) -> int:
    count = int(text)
    if count < 3:
        raise argparse.ArgumentTypeError(f"expected at least 3 worker threads, got {count}")
    return count


def count(text: str) -> int:
    """argparse type: an integer >= 0."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {value}")
    return value


def port(text: str) -> int:
    """argparse type: a TCP port, 0 for a free one."""
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port in 0..65535, got {value}")
    return value


def http_port(text: str) -> int:
    return -1 if int(text) == -1 else port(text)


def positive(text: str) -> float:
    """argparse type: a finite number > 0."""
    value = float(text)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text}")
    return value


def report_stale_segments(instance: str | None, remove: bool) -> None:
    """Segments named after this instance that exist before it starts were left by a server that died."""
    if instance is None:
        return
    stale = segments(f"rpd_{instance}_")
    if not stale:
        return
    if remove:
        for name in stale:
            remove_segment(name)
        print(f"removed {len(stale)} stale shared-memory segment(s) of instance {instance}: {stale}", flush=True)
    else:
        # No running server holds this instance (this one has its lock): a server that died left them.
        print(f"warning: {len(stale)} shared-memory segment(s) of instance {instance} survive a previous server "
              f"that died: {stale}. Buffers of those names cannot be created until they are removed "
              "(--remove-stale, or `replayd segments --instance ... --remove`), or reattached (--recover).",
              flush=True)


def list_segments(args: argparse.Namespace) -> None:
    prefix = f"rpd_{args.instance}_" if args.instance else "rpd_"
    by_instance: dict[str, list[str]] = {}
    for name in segments(prefix):  # rpd_<instance>_<buffer>[.data]; instance names have no "_"
        by_instance.setdefault(name.split("_")[1], []).append(name)
    if not by_instance:
        print(f"no replayd segments in {SHM_DIR}" + (f" for instance {args.instance}" if args.instance else ""))
        return
    removed, live = 0, []
    for instance, names in by_instance.items():
        lock = None
        try:  # held while removing: a server starting under this instance meanwhile waits, then is refused
            lock = InstanceLock(instance, wait_seconds=0)
        except FailedPrecondition:
            live.append(instance)
        for name in names:
            print(name + (f"  (in use: instance {instance} is being served)" if lock is None else ""))
            if args.remove and lock is not None:
                remove_segment(name)
                removed += 1
        if lock is not None:
            lock.release()
    if args.remove:
        kept = f"; kept those of running instance(s) {live}" if live else ""
        print(f"removed {removed} segment(s){kept}")


def serve(args: argparse.Namespace) -> None:
    tune_allocator()
    http_address = None if args.http_port < 0 else f"{args.host}:{args.http_port}"
    max_buffer_bytes = None if args.max_buffer_gb is None else int(args.max_buffer_gb * 2**30)
    try:  # takes the instance's lock: from here on, segments named after it are ours or a dead server's
        tls_cert = Path(args.tls_cert).read_bytes() if args.tls_cert else None
        tls_key = Path(args.tls_key).read_bytes() if args.tls_key else None
        server = ReplayServer(f"{args.host}:{args.port}", instance=args.instance,
                              max_message_bytes=int(args.max_message_mb * 2**20), http_address=http_address,
                              token=args.token or None, tls_cert=tls_cert, tls_key=tls_key,
                              max_buffer_bytes=max_buffer_bytes, sample_workers=args.sample_workers,
                              recover=args.recover, max_workers=args.max_workers,
                              checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every,
                              checkpoint_keep=args.checkpoint_keep or None, restore_from=args.restore)
    except (ReplayError, OSError) as exc:
        raise SystemExit(f"replayd: {exc}") from None
    if not args.recover:
        report_stale_segments(args.instance, args.remove_stale)
    # Before start: a SIGTERM during a long restore (docker stop) must end in stop(), which unlinks.
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    try:
        server.start()
    except (ReplayError, OSError, TimeoutError) as exc:  # start() stopped what it had started and unlinked
        raise SystemExit(f"replayd: {exc}") from None
    http = f", {'HTTPS' if tls_cert else 'HTTP'} on port {server.http.port}" if server.http else ""
    security = ", token required" if args.token else ", no token"
    print(f"replayd {server.instance} listening on {server.address}{' (TLS)' if tls_cert else ''}{http}{security}",
          flush=True)
    stop.wait()
    server.stop()
    print("replayd stopped; shared memory unlinked", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="replayd", description="Experience-replay server for RL.")
    parser.add_argument("--version", action="version", version=f"replayd {replayd.__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    serve_parser = commands.add_parser("serve", help="run the gRPC replay server")
    serve_parser.add_argument("--host", default="127.0.0.1",
                              help="bind address (default 127.0.0.1; 0.0.0.0 accepts remote actors and needs "
                                   "--token or --insecure-bind-all)")
    serve_parser.add_argument("--port", type=port, default=50051, help="gRPC port (default 50051)")
    serve_parser.add_argument("--instance", default=None, type=instance_name,
                              help="names the shared-memory segments (rpd_<instance>_<buffer>); random by default")
    serve_parser.add_argument("--max-message-mb", type=positive, default=512.0,
                              help="largest gRPC message either way (gRPC's default is 4 MB)")
    serve_parser.add_argument("--recover", action="store_true",
                              help="reattach to the buffers a killed server of this --instance left in shared "
                                   "memory; buffers that fail the consistency checks come from --restore "
                                   "(without it, from the latest checkpoint in --checkpoint-dir)")
    serve_parser.add_argument("--remove-stale", action="store_true",
                              help="unlink segments of this --instance left by a server that died")
    serve_parser.add_argument("--sample-workers", type=count, default=0,
                              help="extra processes serving Sample/SampleStream from the shared memory "
                                   "(sampling then scales with cores; inserts stay with this process)")
    serve_parser.add_argument("--max-workers", type=worker_count, default=64,
                              help="gRPC worker threads: one per call in progress. Open streams may hold 3/8 of "
                                   "them and calls blocked on a rate limiter or waiting for data 3/8; one more gets "
                                   "UNAVAILABLE (retried by clients), so a quarter stays free for short calls")
    serve_parser.add_argument("--http-port", type=http_port, default=8080,
                              help="health, /metrics and the status page (default 8080; 0 picks a free port, "
                                   "-1 turns it off)")
    serve_parser.add_argument("--max-buffer-gb", type=positive, default=None,
                              help="shared memory one buffer may take (default: what /dev/shm has free)")
    serve_parser.add_argument("--token", default=os.environ.get("REPLAYD_TOKEN", ""),
                              help="require 'authorization: Bearer <token>' on gRPC calls and HTTP requests but "
                                   "/healthz (default: $REPLAYD_TOKEN; none when unset)")
    serve_parser.add_argument("--tls-cert", default=None, help="PEM certificate chain: serve gRPC over TLS")
    serve_parser.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    serve_parser.add_argument("--insecure-bind-all", action="store_true",
                              help="allow a non-loopback --host without --token (trusted networks only)")
    serve_parser.add_argument("--restore", default=None, metavar="DIR",
                              help="restore the buffers of a checkpoint before serving (DIR's LATEST, or DIR itself "
                                   "when it is one checkpoint)")
    serve_parser.add_argument("--checkpoint-dir", default=None, metavar="DIR",
                              help="where periodic checkpoints go, and the only place the Checkpoint RPC "
                                   "writes (in it, or a subdirectory the request names)")
    serve_parser.add_argument("--checkpoint-every", type=positive, default=None, metavar="SECONDS",
                              help="write a checkpoint of every buffer this often (needs --checkpoint-dir)")
    serve_parser.add_argument("--checkpoint-keep", type=count, default=3,
                              help="after each periodic checkpoint, keep the newest this many complete "
                                   "checkpoints in --checkpoint-dir, Checkpoint RPC ones included (0: keep all)")
    serve_parser.add_argument("--log-level", default="INFO", type=str.upper,
                              choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"])
    # Actors and learners need the client extras (torch, gymnasium); they are imported only when asked for,
    # so the server never imports torch.
    commands.add_parser("actor", help="run an actor (python -m replayd.client.actor --help)", add_help=False)
    commands.add_parser("learn", help="run a learner (python -m replayd.client.learner --help)", add_help=False)
    # Needs the `ray` extra; Ray is imported by replayd.client.ray alone, only when this command runs.
    commands.add_parser("ray", help="replay shards, actors and learners on a Ray cluster (replayd ray --help)",
                        add_help=False)
    segments_parser = commands.add_parser("segments", help="list (and remove) replayd shared-memory segments")
    segments_parser.add_argument("--instance", default=None, type=instance_name,
                                 help="only this server instance's segments")
    segments_parser.add_argument("--remove", action="store_true", help="unlink them (only for dead servers!)")
    args, rest = parser.parse_known_args(argv)
    if args.command == "segments":
        if rest:  # a mistyped --remove only listed them, and said nothing
            segments_parser.error(f"unrecognized arguments: {' '.join(rest)}")
        list_segments(args)
        return
    if args.command == "actor":
        from replayd.client.actor import main as actor_main

        actor_main(rest, prog="replayd actor")
        return
    if args.command == "learn":
        from replayd.client.learner import main as learner_main

        learner_main(rest, prog="replayd learn")
        return
    if args.command == "ray":
        from replayd.client.ray.cli import main as ray_main  # imports Ray once a command runs (not for --help)

        ray_main(rest, prog="replayd ray")
        return
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.recover and not args.instance:
        parser.error("--recover needs the --instance name of the server that was killed")
    if bool(args.tls_cert) != bool(args.tls_key):
        parser.error("--tls-cert and --tls-key go together")
    if args.max_message_mb * 2**20 > 2**31 - 1:
        parser.error(f"--max-message-mb: gRPC messages are smaller than 2048 MB, got {args.max_message_mb:g}")
    for flag, value, unit in (("--max-message-mb", args.max_message_mb, 2**20),
                              ("--max-buffer-gb", args.max_buffer_gb, 2**30)):
        if value is not None and int(value * unit) < 1:  # the server counts whole bytes
            parser.error(f"{flag}: {value:g} is less than one byte")
    if ":" in args.host and not args.host.startswith("["):  # an IPv6 address: host:port needs it bracketed
        args.host = f"[{args.host}]"
    most_sample_workers = 4 * (os.cpu_count() or 1)
    if args.sample_workers > most_sample_workers:  # e.g. a typo: each is a process with its own port
        parser.error(f"--sample-workers: expected at most {most_sample_workers} (4 per core of this host), got "
                     f"{args.sample_workers}")
    if args.sample_workers and not lock_free_host():
        parser.error(f"--sample-workers sample shared memory lock-free, which needs an x86-64 host; this one is "
                     f"{platform.machine()!r}")
    if args.tls_cert and args.sample_workers:
        parser.error("--sample-workers serve plain gRPC: run them without --tls-cert (or put TLS in a proxy)")
    if args.checkpoint_every is not None and args.checkpoint_dir is None:
        parser.error("--checkpoint-every needs --checkpoint-dir")
    if args.checkpoint_every is not None and args.checkpoint_every > threading.TIMEOUT_MAX:  # what a wait can take
        parser.error(f"--checkpoint-every: expected at most {threading.TIMEOUT_MAX:.0f} seconds, "
                     f"got {args.checkpoint_every:g}")
    try:
        check_bind(args.host, args.token, args.insecure_bind_all)
        if args.token:
            check_token(args.token)
    except ValueError as exc:
        parser.error(str(exc))
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    serve(args)


if __name__ == "__main__":
    main()
