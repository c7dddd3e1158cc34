"""Runs every bench module, writes bench/results.jsonl and prints a markdown table.

    .venv/bin/python -m bench.run [--quick]      # what `make bench` calls
"""

from __future__ import annotations

import argparse
import importlib
import json
from pathlib import Path

MODULES = ["bench.bench_replay", "bench.bench_pixels", "bench.bench_sequences", "bench.bench_gae",
           "bench.bench_rollout_grpc", "bench.bench_trainers", "bench.bench_prioritized", "bench.bench_shared_memory",
           "bench.bench_load", "bench.bench_shards"]
RESULTS = Path(__file__).resolve().parent / "results.jsonl"


def _fmt(value: float) -> str:
    if value == 0:
        return "0"
    if abs(value) >= 1e5:
        return f"{value:.3g}"
    if abs(value) >= 100:
        return f"{value:.0f}"
    if abs(value) >= 1:
        return f"{value:.2f}"
    return f"{value:.3g}"


def table(records: list[dict]) -> str:
    lines = ["| bench | case | metric | ours | baseline | baseline value | speedup |",
             "|---|---|---|---|---|---|---|"]
    for r in records:
        ours = f"{_fmt(r['value'])} {r['unit']}"
        base = f"{_fmt(r['baseline_value'])} {r['unit']}" if r.get("baseline") else ""
        speedup = f"{r['speedup']:.2f}x" if r.get("speedup") else ""
        lines.append(f"| {r['bench']} | {r['case']} | {r['metric']} | {ours} | {r.get('baseline', '')} | {base} "
                     f"| {speedup} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="replayd benchmarks")
    parser.add_argument("--quick", action="store_true", help="smaller sizes and fewer repeats")
    args = parser.parse_args(argv)
    records: list[dict] = []
    for name in MODULES:
        module = importlib.import_module(name)
        print(f"running {name}{' --quick' if args.quick else ''} ...", flush=True)
        records += module.run(quick=args.quick)
        RESULTS.write_text("".join(json.dumps(r) + "\n" for r in records))  # partial results survive a crash
    print(table(records))
    print(f"\n{len(records)} figures written to {RESULTS}")


if __name__ == "__main__":
    main()
