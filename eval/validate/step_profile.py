"""Where the engine's time goes during a bench replay: busy time against wall time, rows per decode step,
and what a decode step costs by the members in it. The replay, trace and systems are `mfs bench`'s own;
only the executor's execute() is wrapped with a timer (scheduling and tier copies are not counted).

    python -m eval.validate.step_profile --quick --sessions 24 --rate 2 --kv-pages 768 --systems mfs,baseline,no_layer_sharing
    python -m eval.validate.step_profile ... --set engine.num_threads=2     # an oversubscribed engine
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

from eval.bench.cli import add_arguments, config_for, prepare, run_system, settings_from_args
from eval.bench.metrics import mean
from eval.bench.step_timing import BACK_TO_BACK_S, StepTiming, timed


def summarize_steps(timings: list[StepTiming], duration_s: float) -> dict[str, Any]:
    decode = [t for t in timings if t.is_decode_only]
    prefill = [t for t in timings if not t.is_decode_only]
    groups: dict[str, list[StepTiming]] = defaultdict(list)
    for t in decode:
        groups["+".join(sorted(t.seqs_by_member))].append(t)
    by_members = {key: {"steps": len(g), "mean_ms": mean([t.seconds for t in g]) * 1e3,
                        "mean_seqs": mean([sum(t.seqs_by_member.values()) for t in g])}
                  for key, g in sorted(groups.items(), key=lambda kv: -len(kv[1]))}
    gaps = [b.start_s - (a.start_s + a.seconds) for a, b in zip(timings, timings[1:])]
    between = [g for g in gaps if 0 <= g < BACK_TO_BACK_S]
    return {"duration_s": duration_s, "busy_s": sum(t.seconds for t in timings), "steps": len(timings),
            "between_steps_mean_ms": mean([g * 1e3 for g in between]), "back_to_back_steps": len(between),
            "decode_steps": len(decode),
            "decode_mean_ms": mean([t.seconds * 1e3 for t in decode]),
            "decode_mean_seqs": mean([sum(t.seqs_by_member.values()) for t in decode]),
            "prefill_steps": len(prefill), "prefill_mean_ms": mean([t.seconds * 1e3 for t in prefill]),
            "decode_by_members": by_members}


def profile_system(name: str, config: Any, trace) -> dict[str, Any]:
    timings: list[StepTiming] = []

    def instrument(engine):
        execute = engine.core.executor.execute
        engine.core.executor.execute = timed(execute, timings)

        def detach() -> None:            # the bench's after-replay probe is not part of the replay
            engine.core.executor.execute = execute
        return detach

    _, metrics = asyncio.run(run_system(name, config, trace, instrument=instrument))
    out = summarize_steps(timings, metrics["duration_s"])
    out["mean_token_latency_s"] = metrics["mean_token_latency_s"]
    return out


def format_profile(name: str, p: dict[str, Any]) -> str:
    def ms(v):
        return "n/a" if v is None else f"{v:.2f} ms"

    lines = [f"{name}: token latency {ms((p['mean_token_latency_s'] or 0) * 1e3)}, engine busy {p['busy_s']:.1f} s "
             f"of {p['duration_s']:.1f} s, {p['steps']} steps",
             f"  between back-to-back steps (serving loop outside execute): {ms(p['between_steps_mean_ms'])} "
             f"over {p['back_to_back_steps']} gaps",
             f"  decode steps {p['decode_steps']}: {ms(p['decode_mean_ms'])}, {p['decode_mean_seqs'] or 0:.2f} requests "
             f"per step; prefill steps {p['prefill_steps']}: {ms(p['prefill_mean_ms'])}"]
    for key, g in p["decode_by_members"].items():
        lines.append(f"    decode with {key:<22} {g['steps']:>5} steps  {ms(g['mean_ms'])}  {g['mean_seqs']:.2f} requests")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eval.validate.step_profile", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    parser.set_defaults(out="step_profile.json", no_quality=True)
    args = parser.parse_args(argv)
    settings = settings_from_args(args)
    _, trace, split, _ = prepare(settings)
    profiles = {name: profile_system(name, config_for(name, settings, split), trace) for name in settings.systems}
    for name, p in profiles.items():
        print(format_profile(name, p))
    Path(args.out).write_text(json.dumps({"settings": {"command": "python -m eval.validate.step_profile " + " ".join(
        argv if argv is not None else sys.argv[1:])}, "systems": profiles}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
