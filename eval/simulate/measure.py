"""Builds a step table by timing the local engine on this machine (`--cost-model measured`).

For each member: decode steps of `batch` requests at `context` tokens and prefill chunks of `tokens` after
`prefix` cached tokens, each a real LocalExecutor.execute() on a StepPlan built here (page contents do not
change the time: the pages are whatever the arena holds), the median of REPEATS runs after one warm-up. For a
member nested in a larger one, ride_overlap: what its decodes add to the larger member's step when the engine
merges them into one forward, as a share of what they cost alone (RIDE_POINTS, median). Then a
short real LocalServing run (pinned requests streamed through the engine thread and asyncio, as the bench
drives it) gives the serving loop's cost between back-to-back steps (step_overhead_ms), measured the way
eval.validate.step_profile measures it.

    python -m eval.simulate.measure --family tiny --out eval/simulate/tables/tiny_measured.json
    python -m eval.simulate.measure --family tiny-sep --out eval/simulate/tables/tiny-sep_measured.json
    python -m eval.simulate.measure --ride-overlap-into eval/simulate/tables/tiny_measured.json   # only that

A family's table is eval/simulate/tables/<family>_measured.json (its family.yaml name; the default --out), what
`mfs simulate --family F --cost-model measured` and `mfs bench`'s split pilot read. Step times are wall-clock
times: measure with nothing else running on the machine.
"""
from __future__ import annotations

import argparse
import asyncio
import platform
import statistics
import time
from typing import Any

from eval.simulate.step_table import Grid2D, MemberCosts, StepTable, load_table, save_table

DECODE_BATCH = (1, 2, 4, 8, 16, 32)
DECODE_CONTEXT = (16, 128, 256, 512, 1000)
PREFILL_TOKENS = (16, 64, 128, 256, 512)
PREFIX = (0, 128, 256, 480)
MIX_POINTS = ((64, 4, 256), (128, 8, 256), (256, 4, 512))
RIDE_POINTS = ((1, 1), (2, 1), (1, 2), (2, 2), (4, 4), (8, 8))   # (host rows, rider rows), decodes at RIDE_CONTEXT
RIDE_CONTEXT = 256
RIDE_REPEATS = 9                # runs per step shape and round
RIDE_ROUNDS = 3                 # every point again, a round later: the machine drifts within a minute
RIDE_NOTE = (f"ride_overlap: (merged step - host alone) / rider alone for decodes at {RIDE_CONTEXT} tokens, median over "
             f"the larger members it nests in, (host rows, rider rows) in {list(RIDE_POINTS)} and {RIDE_ROUNDS} rounds, "
             f"{RIDE_REPEATS} runs each")
REPEATS = 3
ARENA_PAGES = 4096


def _plan(member, tokens_per_block: int, chunks: list[tuple[int, int, bool]], num_pages: int,
          residuals: bool = False):
    """StepPlan of one member batch; chunks = (start position, new tokens, sample). Pages cycle through the arena.
    residuals: every chunk also writes its exit residual (as serving asks of a member a larger one can start from)."""
    from orchestrator.core.types import MemberBatch, PageId, RequestId, SamplingParams, SeqChunk, StepPlan

    out, next_page = [], 0
    for i, (start, n, sample) in enumerate(chunks):
        blocks = -(-(start + n) // tokens_per_block)
        tables = []
        for _ in range(member.num_layers + (1 if residuals else 0)):
            tables.append([PageId((next_page + b) % num_pages) for b in range(blocks)])
            next_page = (next_page + blocks) % num_pages
        residual_out = tables.pop() if residuals else None
        out.append(SeqChunk(request_id=RequestId(f"p{i}"), token_ids=[5] * n, start_pos=start, block_tables=tables,
                            sample=sample, sampling=SamplingParams(max_tokens=1), residual_table_out=residual_out))
    return StepPlan(batches=[MemberBatch(member.name, out)])


def _time(executor, plan, repeats: int = REPEATS) -> float:
    executor.execute(plan)                     # warm-up: allocations, caches
    runs = []
    for _ in range(repeats):
        started = time.perf_counter()
        executor.execute(plan)
        runs.append((time.perf_counter() - started) * 1e3)
    return statistics.median(runs)


def _executor(family, config):
    """The executor serving runs (orchestrator.serve.local_engine), over ARENA_PAGES pages."""
    from orchestrator.serve.local_engine import local_executor

    return local_executor(config, family, ARENA_PAGES)


def ride_overlaps(family, config, executor=None) -> dict[str, float]:
    """For each member nested in a larger one: median over its hosts, RIDE_POINTS and RIDE_ROUNDS of (merged step
    - host alone) / (rider alone), the three timed in the same seconds (a ratio, so the machine's drift between
    minutes cancels). The engine merges the rider into the host's forward (engines/local/executor.py). Chunks
    write their exit residuals where serving's layout asks for them (the riders of a nested family do)."""
    from eval.simulate.cost_model import rides_in
    from eval.baseline.static_split import config_layout
    from orchestrator.core.types import StepPlan

    executor = executor or _executor(family, config)
    layout = config_layout(family, config)            # block sizes, and who writes exit residuals in serving

    def step(parts: list[tuple[Any, int]]) -> float:
        batches = [b for member, rows in parts
                   for b in _plan(member, layout.tokens_per_block(member.name), [(RIDE_CONTEXT, 1, True)] * rows,
                                  ARENA_PAGES, residuals=layout.records_residual(member.name)).batches]
        return _time(executor, StepPlan(batches=batches), RIDE_REPEATS)

    ratios: dict[str, list[float]] = {}
    for _ in range(RIDE_ROUNDS):
        for rider in family.members:
            for host in family.members:
                if not rides_in(family, rider.name, host.name):
                    continue
                for host_rows, rider_rows in RIDE_POINTS:
                    alone, host_ms = step([(rider, rider_rows)]), step([(host, host_rows)])
                    merged = step([(rider, rider_rows), (host, host_rows)])
                    ratios.setdefault(rider.name, []).append(max(0.0, (merged - host_ms) / alone))
    return {name: statistics.median(values) for name, values in ratios.items()}


def profile_members(family, config) -> dict[str, MemberCosts]:
    from orchestrator.core.family import dtype_bytes

    page_bytes = config.pool.page_bytes
    executor = _executor(family, config)
    size = dtype_bytes(config.engine.dtype)
    rides = ride_overlaps(family, config, executor)
    members = {}
    for member in family.members:
        tpb = member.tokens_per_block(page_bytes, size)
        decode = [[_time(executor, _plan(member, tpb, [(c, 1, True)] * b, ARENA_PAGES)) for c in DECODE_CONTEXT]
                  for b in DECODE_BATCH]
        prefill = [[_time(executor, _plan(member, tpb, [(p, t, True)], ARENA_PAGES)) for p in PREFIX]
                   for t in PREFILL_TOKENS]
        overlaps = []
        for tokens, batch, context in MIX_POINTS:
            mixed = _time(executor, _plan(member, tpb, [(0, tokens, True)] + [(context, 1, True)] * batch, ARENA_PAGES))
            p = _time(executor, _plan(member, tpb, [(0, tokens, True)], ARENA_PAGES))
            d = _time(executor, _plan(member, tpb, [(context, 1, True)] * batch, ARENA_PAGES))
            overlaps.append(max(0.0, (mixed - max(p, d)) / min(p, d)))
        members[member.name] = MemberCosts(
            decode_ms=Grid2D(DECODE_BATCH, DECODE_CONTEXT, tuple(map(tuple, decode))),
            prefill_ms=Grid2D(PREFILL_TOKENS, PREFIX, tuple(map(tuple, prefill))),
            mix_overlap=statistics.median(overlaps), ride_overlap=rides.get(member.name, 1.0),
            model=str(member.checkpoint_dir.name))
    return members


async def _serving_gaps(config, num_requests: int = 4, tokens: int = 48) -> float:
    """Mean gap (ms) between back-to-back execute() calls of a real LocalServing streaming pinned requests."""
    from eval.bench.cli import pinned_request
    from eval.bench.step_timing import BACK_TO_BACK_S, timed
    from orchestrator.serve.serving import LocalServing

    engine = LocalServing(config)
    await engine.start()
    timings: list = []
    try:
        engine.core.executor.execute = timed(engine.core.executor.execute, timings)
        members = engine.family.member_names

        async def one(i: int) -> None:
            async for _ in engine.generate(pinned_request(f"gap-{i}", members[i % len(members)], tokens)):
                pass
        await asyncio.gather(*(one(i) for i in range(num_requests)))
    finally:
        await engine.stop()
    gaps = [b.start_s - (a.start_s + a.seconds) for a, b in zip(timings, timings[1:])]
    between = [g for g in gaps if 0 <= g < BACK_TO_BACK_S]
    return statistics.mean(between) * 1e3 if between else 0.0


def measure_table(family_name: str = "tiny", overrides: dict[str, Any] | None = None) -> StepTable:
    from orchestrator.core.config import load_config
    from orchestrator.core.family import load_family

    config = load_config(overrides={"family": family_name, "engine.device": "cpu", **(overrides or {})})
    family = load_family(family_name)
    started = time.perf_counter()
    members = profile_members(family, config)
    overhead_ms = asyncio.run(_serving_gaps(config))
    return StepTable(source=f"measured: local engine, {family.name} family, {config.engine.dtype}, {platform.machine()} "
                            f"CPU, {time.strftime('%Y-%m-%d')}", members=members, gpu=None, backend="local",
                     step_overhead_ms=round(overhead_ms, 3), copy_gb_s=5.0,
                     notes=[f"profiled in {time.perf_counter() - started:.0f} s; median of {REPEATS} runs per point",
                            "step_overhead_ms: mean gap between back-to-back steps of a real LocalServing run (the "
                            "serving loop outside execute(): scheduling, tier copies, streaming, the GIL)",
                            "copy_gb_s 5: host-memory copy of one page (assumed)",
                            RIDE_NOTE])


def add_ride_overlaps(path: str, family_name: str = "tiny") -> StepTable:
    """Measures ride_overlap now and writes it into an existing table, keeping its grid (a ratio of steps timed
    together, so it combines with a grid timed at another moment)."""
    import dataclasses

    from orchestrator.core.config import load_config
    from orchestrator.core.family import load_family

    table = load_table(path)
    config = load_config(overrides={"family": family_name, "engine.device": "cpu"})
    rides = ride_overlaps(load_family(family_name), config)
    members = {name: dataclasses.replace(m, ride_overlap=rides.get(name, 1.0)) for name, m in table.members.items()}
    notes = [n for n in table.notes if not n.startswith("ride_overlap:")]
    notes.append(f"{RIDE_NOTE}; measured {time.strftime('%Y-%m-%d %H:%M')} UTC, after the grid")
    table = dataclasses.replace(table, members=members, notes=notes)
    save_table(table, path)
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eval.simulate.measure", description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", default="tiny", help="shipped family name or family directory")
    parser.add_argument("--out", default=None,
                        help="the table to write (default: eval/simulate/tables/<family>_measured.json, what mfs "
                             "simulate reads for that family)")
    parser.add_argument("--ride-overlap-into", metavar="TABLE",
                        help="measure only ride_overlap (nested members merged into a larger member's forward) and "
                             "write it into this existing table")
    args = parser.parse_args(argv)
    if args.ride_overlap_into:
        table = add_ride_overlaps(args.ride_overlap_into, args.family)
        print(f"wrote {args.ride_overlap_into}: ride_overlap " + ", ".join(
            f"{n} {m.ride_overlap:.2f}" for n, m in table.members.items()))
        return 0
    from eval.simulate.paths import measured_table_path
    from orchestrator.core.family import load_family

    out = args.out or str(measured_table_path(load_family(args.family).name))
    table = measure_table(args.family)
    save_table(table, out)
    print(f"wrote {out}: step overhead {table.step_overhead_ms:.2f} ms; decode batch 1 @128: " + ", ".join(
        f"{n} {m.decode_ms(1, 128):.2f} ms" for n, m in table.members.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
