"""Runs every bench module, writes bench/results.jsonl, prints the tables and rewrites the README's headline
table from them.

    .venv/bin/python -m bench.run [--quick]      # what `make bench` calls

results.jsonl holds one JSON object a line: first the machine the run measured (bench/machine.py), then one
per figure, each beside the baseline it is compared with in the same run. bench/report.py renders them (the
documentation's performance page is built from the committed file).
"""

from __future__ import annotations

import argparse
import importlib
import json

from bench import report
from bench.machine import machine_record

MODULES = ["bench.bench_replay", "bench.bench_pixels", "bench.bench_sequences", "bench.bench_gae",
           "bench.bench_rollout_grpc", "bench.bench_trainers", "bench.bench_prioritized", "bench.bench_shared_memory",
           "bench.bench_load", "bench.bench_shards"]
RESULTS = report.RESULTS


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="replayd benchmarks")
    parser.add_argument("--quick", action="store_true", help="smaller sizes and fewer repeats")
    args = parser.parse_args(argv)
    records: list[dict] = [machine_record(args.quick)]
    for name in MODULES:
        module = importlib.import_module(name)
        print(f"running {name}{' --quick' if args.quick else ''} ...", flush=True)
        records += module.run(quick=args.quick)
        RESULTS.write_text("".join(json.dumps(r) + "\n" for r in records))  # partial results survive a crash
    print(report.render_page(RESULTS))
    report.main(["--readme"])
    print(f"\n{len(records) - 1} figures written to {RESULTS}")


if __name__ == "__main__":
    main()
