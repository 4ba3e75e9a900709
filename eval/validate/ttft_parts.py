"""Where a real request's time to first token goes: the way in, the wait for the first step that holds it, the
steps until the one that samples its first token, and the way out (docs/SIMULATOR.md, Validation).

One real rate of the bench's trace is replayed through the bench's own run_system with every execute() timed and
the request ids of its chunks kept; each request's TTFT is then cut at those points (time.monotonic throughout;
a record's replay-clock times are mapped through its arrival, taken together with its send time).

    python -m eval.validate.ttft_parts --quick --rate 0.5 --system mfs
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from dataclasses import replace
from typing import Any

PARTS = ("ttft", "in", "queue", "steps", "out")

# (start, end, [(request id, samples a token)]) of one execute(), time.monotonic()
StepSpan = tuple[float, float, list[tuple[str, bool]]]


def ttft_parts(records: list, steps: list[StepSpan], edges: dict[str, tuple[float, float]], tag: str
               ) -> dict[str, list[float]]:
    """Per request with a first token: ttft = in (client's call -> scheduler) + queue (-> the first step holding it
    starts) + steps (-> the step that samples its first token ends) + out (-> the client records the token).
    edges: request id -> (arrival, when it entered the scheduler)."""
    first_in: dict[str, float] = {}
    first_sample: dict[str, float] = {}
    for start, end, chunks in steps:
        for request_id, sample in chunks:
            first_in.setdefault(request_id, start)
            if sample:
                first_sample.setdefault(request_id, end)
    out: dict[str, list[float]] = {part: [] for part in PARTS}
    for record in records:
        request_id = f"{tag}-{record.session_id}-t{record.turn_index}"
        if record.first_token_s is None or request_id not in edges or request_id not in first_sample:
            continue
        arrival, added = edges[request_id]
        client_first = record.first_token_s + (arrival - record.send_s)
        out["ttft"].append(record.first_token_s - record.send_s)
        out["in"].append(added - arrival)
        out["queue"].append(first_in[request_id] - added)
        out["steps"].append(first_sample[request_id] - first_in[request_id])
        out["out"].append(client_first - first_sample[request_id])
    return out


def run(settings: Any, system: str) -> dict[str, list[float]]:
    """One real replay of `system` at settings.rate, instrumented; its TTFT parts."""
    from eval.bench.cli import config_for, prepare, run_system

    _, trace, split, _ = prepare(settings)
    steps: list[StepSpan] = []
    edges: dict[str, tuple[float, float]] = {}

    def instrument(engine):
        execute, add_request = engine.core.executor.execute, engine.core.add_request

        def timed(plan):
            started = time.monotonic()
            result = execute(plan)
            steps.append((started, time.monotonic(),
                          [(chunk.request_id, chunk.sample) for batch in plan.batches for chunk in batch.chunks]))
            return result

        def stamped(request, sink):
            edges[request.request_id] = (request.arrival_s, time.monotonic())
            return add_request(request, sink)
        engine.core.executor.execute, engine.core.add_request = timed, stamped

        def detach():
            engine.core.executor.execute, engine.core.add_request = execute, add_request
        return detach
    records, _ = asyncio.run(run_system(system, config_for(system, settings, split), trace, instrument=instrument))
    return ttft_parts(records, steps, edges, system)


def main(argv: list[str] | None = None) -> int:
    from eval.bench.cli import BenchSettings

    parser = argparse.ArgumentParser(prog="python -m eval.validate.ttft_parts", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rate", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--system", default="mfs")
    args = parser.parse_args(argv)
    base = BenchSettings.quick_defaults() if args.quick else BenchSettings()
    settings = replace(base, rate=args.rate, seed=args.seed, systems=(args.system,), score_quality=False,
                       progress=False)
    parts = run(settings, args.system)
    if not parts["ttft"]:
        print("no request produced a first token")
        return 1
    for part in PARTS:
        values = parts[part]
        print(f"{part:<6} p50 {statistics.median(values) * 1e3:8.3f} ms  mean {statistics.mean(values) * 1e3:8.3f} ms"
              f"  ({len(values)} requests)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
