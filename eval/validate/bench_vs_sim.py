"""Validation: the CPU bench's load curve run for real and in simulation on the same traces, and the errors.

For each rate: one trace (the bench's), run by `mfs bench`'s own run_system for every system with the engine's
execute() timed (shapes, start and seconds of every step, the gaps between back-to-back steps, and each request's
way in and out of the engine), and the replies'
per-token confidences recorded. Then a linear cost model is fitted to the observed steps of the OTHER rates
(leave-one-rate-out: the simulated rate's own steps never set its costs; held_out_calibrated scales that fit by
one number, the run's own one-request decode steps against the fit runs', i.e. the machine's speed during the
run; table_held_out is the step table of this machine timed offline (eval.simulate.measure, batch sizes 1-32)
scaled by the other rates' median real / table; table_held_out_serving that table at the other rates' speed with
their gap, history terms, serving edge and the fixed extra a prefill step costs in serving; table_calibrated that
table at the run's own speed with the history terms and serving edge fitted on the other rates), to every rate's
steps (in_sample), and
to that rate's runs' steps (same_run: on a shared machine the cost of a step drifts between runs), and to each
system's own run only (own_steps: a shared virtual machine's speed drifts by up to 2x within a minute, so even two systems run one
after the other at one rate see different machines; this variant isolates how well the simulated core reproduces
queueing and batching given the step costs the machine had during that very run), and
the same trace is simulated with the bench's configs and each system's own recorded confidences (a request
decoded on the same member in another system's batches can cross the escalation threshold elsewhere, by the last
bits of a probability). Reported per system and
rate: mean token latency, TTFT p50/p90, TPOT p50 and throughput, simulated / real - 1, and whether the systems
are ordered the same way; and a fixed workload timed before and after every real run (machine_probe_ms), so the
machine's own drift is on record beside the errors.

    python -m eval.validate.bench_vs_sim --quick --rates 0.5,1,2 --out validation.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import pickle
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from eval.bench.cli import BenchSettings, config_for, parse_overrides, prepare, run_system as run_real
from eval.bench.confidence_file import request_key, write_library
from eval.bench.step_timing import BACK_TO_BACK_S
from eval.simulate.confidence import ConfidenceLibrary
from eval.simulate.cost_model import CostModel, plan_shapes
from eval.simulate.fleet import Placement
from eval.simulate.setup import SimSetup
from eval.simulate.step_table import StepTable, load_table, save_table
from eval.validate.variant_costs import calibrated, fit, probe_scaled, table_calibrated, table_held_out, table_held_out_serving

METRICS = (("mean_token_latency_s", "mean token latency"), ("ttft_p50_s", "TTFT p50"), ("ttft_p90_s", "TTFT p90"),
           ("tpot_p50_s", "TPOT p50"), ("throughput_tok_s", "throughput"))
TARGET_ERROR = 0.15
VARIANTS = ("held_out", "held_out_scaled", "held_out_calibrated", "table_held_out", "table_held_out_serving",
            "table_calibrated", "in_sample",
            "same_run", "own_steps")


def _instrument(log: list, edges: dict | None = None):
    """run_system's instrument hook: every execute() appended as (start, seconds, [BatchShape]); and, with
    `edges`, per request id [its arrival (the client's call), when it entered the scheduler, when the engine
    handed its last output over] (time.monotonic())."""
    def attach(engine):
        execute = engine.core.executor.execute
        add_request = engine.core.add_request

        def timed(plan):
            started = time.perf_counter()
            out = execute(plan)
            shapes = plan_shapes(plan, engine.family)
            log.append((started, time.perf_counter() - started, shapes))
            return out
        engine.core.executor.execute = timed

        def stamped_add(request, sink):
            entry = [request.arrival_s, time.monotonic(), None]

            def stamped_sink(item):
                if getattr(item, "finished", False):
                    entry[2] = time.monotonic()
                sink(item)
            if edges is not None:
                edges[request.request_id] = entry
            return add_request(request, stamped_sink)
        engine.core.add_request = stamped_add

        def detach():
            engine.core.executor.execute = execute
            engine.core.add_request = add_request
        return detach
    return attach


def request_path_of(records: list, edges: dict, tag: str) -> dict[str, list[float]]:
    """Per finished request of one real run: seconds from the client's call to the scheduler (in) and from the
    engine handing the last output over to the client recording it (out). A record's times are on the replay's
    clock and the edges on time.monotonic(): a request's arrival_s (monotonic) and send_s (replay clock) were
    taken together, so their difference maps one clock onto the other."""
    inbound, outbound = [], []
    for record in records:
        entry = edges.get(f"{tag}-{record.session_id}-t{record.turn_index}")
        if entry is None or record.finish_s is None or entry[2] is None:
            continue
        arrival, added, handed = entry
        inbound.append(added - arrival)
        outbound.append(record.finish_s + (arrival - record.send_s) - handed)
    return {"in_s": inbound, "out_s": outbound}


def machine_probe_ms(repeats: int = 5) -> list[float]:
    """The machine's speed now: ms for a fixed decode-shaped workload (batch 32 through 8 layers of tiny-l's
    MLP widths and its LM head), `repeats` times. The same work taking longer = a slower machine (a virtual
    machine's vCPUs share physical cores with other tenants: seen drifting 3.4-6.7 ms within 30 s with nothing else here)."""
    import torch

    gen = torch.Generator().manual_seed(0)
    x0 = torch.randn(32, 256, generator=gen)
    up, down, head = (torch.randn(256, 640, generator=gen), torch.randn(640, 256, generator=gen),
                      torch.randn(256, 4096, generator=gen))
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        for _ in range(20):
            x = x0
            for _ in range(8):
                x = (x @ up) @ down
            x @ head
        times.append((time.perf_counter() - started) / 20 * 1e3)
    return times


def own_confidences(conf_path: Path, system: str) -> Path:
    """Where one system's recorded confidences of a real run lie, beside the shared file."""
    return conf_path.with_name(f"{conf_path.stem}_{system}{conf_path.suffix}")


def run_real_rate(settings: BenchSettings, conf_path: Path) -> dict[str, Any]:
    family, trace, split, notes = prepare(settings)
    if settings.trace_file:                  # a saved trace keeps its sessions; its arrivals move to this rate
        trace = trace.at_rate(settings.rate)
    out: dict[str, Any] = {"trace": trace, "split": split, "systems": {}, "steps": {}, "probe_ms": {}, "replies": {}}
    records_all = []
    note = f"validation rate {settings.rate} seed {settings.seed}"
    for name in settings.systems:
        log: list = []
        edges: dict = {}
        before = machine_probe_ms()
        records, metrics = asyncio.run(run_real(name, config_for(name, settings, split), trace,
                                                instrument=_instrument(log, edges)))
        out["probe_ms"][name] = {"before": before, "after": machine_probe_ms()}
        records_all += records
        # Each system's own confidences as well: the same request decoded on the same member in another system's
        # batches can differ in its last bits, and one probability on the other side of the escalation threshold
        # changes where the request runs. The shared file keeps the first system's sequence for such a request.
        write_library(records, own_confidences(conf_path, name), family.name, f"{note}, {name}")
        # The replies as generated: the simulation replays them, so each closed-loop turn's prompt (and what the
        # router reads in it) is the real run's, not a seeded token stream's.
        out["replies"][name] = {request_key(r.session_id, r.turn_index): list(r.output_token_ids)
                                for r in records if r.ok}
        out["systems"][name] = metrics   # summarize() already carries ttft_p90_s
        gaps = [b[0] - (a[0] + a[1]) for a, b in zip(log, log[1:])]
        out["steps"][name] = {"observations": [(shapes, seconds) for _, seconds, shapes in log],
                              "starts_s": [started for started, _, _ in log],      # for the history terms
                              "gaps_s": [g for g in gaps if 0 <= g < BACK_TO_BACK_S],
                              "request_path": request_path_of(records, edges, name)}
    write_library(records_all, conf_path, family.name, note)
    return out


def simulate_rate(settings: BenchSettings, real_rate: dict, cost: CostModel | dict[str, Any],
                  conf_path: Path, replay_replies: bool = False) -> dict[str, Any]:
    """Every system simulated on `cost` (one model, or one per system), replaying each system's real replies when
    the run saved them and replay_replies (else the seeded token stream)."""
    from eval.simulate.cli import run_system as run_sim
    from orchestrator.core.family import load_family
    from orchestrator.serve.tokenizer import FamilyTokenizer

    family = load_family(settings.family)
    tokenizer = FamilyTokenizer(family.members[0].checkpoint_dir)
    out = {}
    for name in settings.systems:
        # each system replays its own real run's confidences (work dirs from before they were recorded: the shared)
        own = own_confidences(conf_path, name)
        library = ConfidenceLibrary.load(own if own.is_file() else conf_path, seed=settings.seed)
        library.map_members(family.member_names, family.member_names)
        setup = SimSetup(family_name=family.name, family=None, member_names=family.member_names,
                         cost=cost[name] if isinstance(cost, dict) else cost, placement=Placement("colocated"),
                         num_pages=settings.kv_pages, page_bytes=0, split=None)
        replies = real_rate.get("replies", {}).get(name) if replay_replies else None
        _, metrics = run_sim(name, config_for(name, settings, real_rate["split"]), setup, real_rate["trace"], library,
                             tokenizer.vocab_size, 0.5, replies=replies)
        out[name] = metrics
    return out


def compare(real: dict[str, Any], sim: dict[str, Any]) -> dict[str, Any]:
    errors = {name: {key: (sim[name][key] / real[name][key] - 1.0) if real[name].get(key) and sim[name].get(key) is not None
                     else None for key, _ in METRICS} for name in real}
    order_real = sorted(real, key=lambda n: real[n]["mean_token_latency_s"] or 0)
    order_sim = sorted(sim, key=lambda n: sim[n]["mean_token_latency_s"] or 0)
    return {"errors": errors, "order_real": order_real, "order_sim": order_sim, "same_order": order_real == order_sim,
            "real": {n: {k: real[n].get(k) for k, _ in METRICS} for n in real},
            "simulated": {n: {k: sim[n].get(k) for k, _ in METRICS} for n in sim}}


def step_table_for(path: str | None, work: Path, family: str) -> StepTable:
    """The given step table, else the one in the work dir, else one timed now (about 12 s on the tiny family)."""
    if path:
        return load_table(path)
    saved = work / "step_table.json"
    if not saved.is_file():
        from eval.simulate.measure import measure_table

        save_table(measure_table(family), saved)
    return load_table(saved)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eval.validate.bench_vs_sim", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", default="0.5,1,2")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--systems", default="mfs,baseline")
    parser.add_argument("--family", default="tiny",
                        help="shipped family name or family directory (e.g. one of build_scripts/random_family.py)")
    parser.add_argument("--kv-pages", type=int, default=None, help="arena pages (default: the bench's)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="config override for every system, YAML value (e.g. escalation.enabled=false)")
    parser.add_argument("--trace", default=None, metavar="FILE",
                        help="replay a trace saved by `mfs bench --save-trace` at each rate (no ShareGPT package "
                             "needed: eval/simulate/data/quick_trace_seed0.json is the quick trace of seed 0)")
    parser.add_argument("--work-dir", default=".cache/mfs/validation")
    parser.add_argument("--out", default="validation.json")
    parser.add_argument("--save-fit", default=None, metavar="FILE", help="write the fit over every rate (mfs-step-fit/1)")
    parser.add_argument("--reuse", action="store_true", help="reuse the real runs saved in --work-dir by an earlier call")
    parser.add_argument("--step-table", default=None, metavar="FILE",
                        help="the step table of this machine for the table_* variants (default: timed now with "
                             "eval.simulate.measure into --work-dir, or the one an earlier call left there)")
    parser.add_argument("--token-stream", choices=("replay", "hash"), default="replay",
                        help="replay (default): the simulated replies are the real run's own, so each "
                             "closed-loop turn's prompt, and the routing that reads it, is the real one (runs saved "
                             "without replies fall back to hash); hash: the seeded token stream mfs "
                             "simulate uses where no real run exists (a workload difference on top of the model's: "
                             "up to 25%% on trace seed 1, docs/SIMULATOR.md)")
    args = parser.parse_args(argv)
    rates = [float(r) for r in args.rates.split(",")]
    base = BenchSettings.quick_defaults() if args.quick else BenchSettings()
    base = replace(base, family=args.family, extra_overrides=parse_overrides(args.set, "validate"), trace_file=args.trace,
                   kv_pages=args.kv_pages if args.kv_pages is not None else base.kv_pages)
    systems = tuple(s for s in args.systems.split(",") if s)
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    table = step_table_for(args.step_table, work, base.family)     # this machine's engine, timed alone, first
    real, results = {}, {}
    for rate in rates:
        settings = replace(base, rate=rate, seed=args.seed, systems=systems, score_quality=False, progress=False)
        saved = work / f"real_r{rate}.pkl"      # the real runs are the slow part: kept for --reuse
        if args.reuse and saved.is_file():
            real[rate] = (settings, pickle.loads(saved.read_bytes()))
        else:
            real[rate] = (settings, run_real_rate(settings, work / f"confidences_r{rate}.json"))
            saved.write_bytes(pickle.dumps(real[rate][1]))
    from orchestrator.core.family import load_family

    members = load_family(base.family).member_names
    replay = args.token_stream == "replay"
    runs = {r: real[r][1] for r in rates}
    in_sample = fit(runs, rates, members)      # the same for every rate (and what --save-fit writes)
    for rate in rates:
        settings, real_rate = real[rate]
        others = [r for r in rates if r != rate] or [rate]
        held_out = fit(runs, others, members)
        same_run = fit(runs, [rate], members)
        own_steps = {name: fit(runs, [rate], members, system=name) for name in systems}
        held_out_scaled = probe_scaled(runs, others, rate, systems, held_out)
        held_out_calibrated = calibrated(runs, others, rate, systems, held_out)
        table_model = table_held_out(table, runs, others, held_out.overhead_s)
        table_cal = table_calibrated(table, real_rate, systems, held_out)
        table_serving = table_held_out_serving(table, runs, others, held_out)
        conf = work / f"confidences_r{rate}.json"

        def variant(cost: CostModel | dict[str, Any]) -> dict[str, Any]:
            """One cost model's simulation of this rate against the real run, with the model it used."""
            described = {n: m.describe() for n, m in cost.items()} if isinstance(cost, dict) else cost.describe()
            return {**compare(real_rate["systems"], simulate_rate(settings, real_rate, cost, conf, replay)),
                    "cost_model": described}
        results[str(rate)] = {"held_out": variant(held_out), "table_held_out": variant(table_model),
                              "in_sample": variant(in_sample),
                              "same_run": variant(same_run), "own_steps": variant(own_steps),
                              "machine_probe_ms": real_rate.get("probe_ms")}
        if held_out_scaled is not None:
            results[str(rate)]["held_out_scaled"] = variant(held_out_scaled)
        if held_out_calibrated is not None:
            results[str(rate)]["held_out_calibrated"] = variant(held_out_calibrated)
        if table_cal is not None:
            results[str(rate)]["table_calibrated"] = variant(table_cal)
        if table_serving is not None:
            results[str(rate)]["table_held_out_serving"] = variant(table_serving)
    def worst_of(variant: str) -> float | None:
        return max((abs(n["mean_token_latency_s"]) for r in results.values() if variant in r
                    for n in r[variant]["errors"].values() if n["mean_token_latency_s"] is not None), default=None)
    worst = worst_of("held_out")
    summary = {"rates": rates, "systems": list(systems), "target_error": TARGET_ERROR, "token_stream": args.token_stream,
               "worst_abs_error_mean_token_latency_held_out": worst,
               "worst_abs_error_mean_token_latency": {v: worst_of(v) for v in VARIANTS},
               "same_order_every_rate": {v: all(r[v]["same_order"] for r in results.values() if v in r)
                                         for v in VARIANTS if any(v in r for r in results.values())},
               "same_order_every_rate_held_out": all(r["held_out"]["same_order"] for r in results.values()),
               "by_rate": results, "command": "python -m eval.validate.bench_vs_sim " + " ".join(sys.argv[1:] if argv is None else argv)}
    Path(args.out).write_text(json.dumps(summary, indent=1, default=str))
    if args.save_fit:          # the in-sample fit over every rate: mfs simulate's default measured cost model
        Path(args.save_fit).write_text(json.dumps(in_sample.to_dict(), indent=1))
        print(f"wrote {args.save_fit}")
    for rate, r in results.items():
        for variant in (v for v in VARIANTS if v in r):
            for name, errs in r[variant]["errors"].items():
                real_v = r[variant]["real"][name]["mean_token_latency_s"]
                sim_v = r[variant]["simulated"][name]["mean_token_latency_s"]
                print(f"rate {rate} {variant:<15} {name:<9} tok-lat real {real_v * 1e3:7.2f} sim {sim_v * 1e3:7.2f} ms | " +
                      "  ".join(f"{label} {e * 100:+.0f}%" for (key, label) in METRICS if (e := errs[key]) is not None) +
                      f" | order {'same' if r[variant]['same_order'] else 'DIFFERENT'}")
    for variant, value in summary["worst_abs_error_mean_token_latency"].items():
        if value is not None:
            print(f"worst |error| of mean token latency ({variant}): {value * 100:.1f}% (target {TARGET_ERROR * 100:.0f}%)")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
