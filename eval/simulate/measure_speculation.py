"""Draft-target speculation on the local engine: how often each smaller member's drafts are accepted by each
larger one (prompts of the shipped workload, temperature 0 and 1), and with --costs the draft and verify step
costs for k = 1..4 at batch 1, 4 and 16.

Acceptance does not depend on timing: it is what the table records. Costs are wall-clock times of this machine;
on a shared machine they are noisy, and the table says so (re-measure them alone before using them).

    python -m eval.simulate.measure_speculation --family tiny      # writes eval/simulate/tables/tiny_speculation.json
    python -m eval.simulate.measure_speculation --costs --device cuda --out speculation_cuda.json

`SpeculativeRun` is the core's speculation bookkeeping in miniature (orchestrator/core/types.py, DraftSpec): it
builds each step's plan by hand (a prefill, then decode chunks that draft k tokens with another member), and
applies what the engine returns (target computed = start + 1 + accepted; the draft's computed length as the
contract gives it; the end of a request by the core's own rule, Sequence.stop_reason). The engine's tests drive it
too. It does not run the core's step (EngineCore): the core drafts with the smallest member only, a draft length of
its own choosing, for the member routing picks, where this measures every (drafter, target) pair at a fixed k.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eval.simulate.paths import speculation_table_path
from orchestrator.core.family import load_family
from orchestrator.core.sequence import Sequence
from orchestrator.core.types import (DraftSpec, MemberBatch, PageId, Request, RequestId, SampledToken, SamplingParams,
                                     SeqChunk, StepPlan)

TABLE_FORMAT = "mfs-speculation-table/1"
TRACE = Path(__file__).resolve().parent / "data" / "quick_trace_seed0.json"
DRAFT_TOKENS = 4                    # k of the acceptance runs (per-position rates up to it)
NEW_TOKENS = 64
TEMPERATURES = (0.0, 1.0)
COST_K = (1, 2, 3, 4)
COST_BATCH = (1, 4, 16)
COST_CONTEXT = 128
REPEATS = 5
ARENA_PAGES = 4096
COSTS_NOTE = (f"costs: wall-clock medians of {REPEATS} runs after a warm-up, decodes at {COST_CONTEXT} tokens of "
              "context; verify_ms = step_ms - draft_ms. Timed while other work may have shared the machine: "
              "re-measure them alone (--costs) before using them as figures")


@dataclass(slots=True)
class Decode:
    """One request as SpeculativeRun schedules it: prefill on `target`, then decode, drafting `k` tokens a step
    with `drafter` (None or k = 0: plain decoding)."""

    request_id: str
    prompt: list[int]
    target: str
    sampling: SamplingParams
    drafter: str | None = None
    k: int = 0
    tables: list[list[PageId]] = field(default_factory=list)         # the target's, per layer
    draft_tables: list[list[PageId]] = field(default_factory=list)   # the drafter's, per layer
    tokens: list[SampledToken] = field(default_factory=list)         # kept, in order
    target_done: int = 0            # positions whose target KV is computed
    draft_done: int = 0             # positions whose draft KV is computed
    finished: bool = False
    dropped: int = 0                # tokens the engine returned after the request's stop
    verified: list[tuple[int, int, bool]] = field(default_factory=list)   # (k, tokens returned, ended there)
    seq: Sequence = field(init=False)   # the core's record of it on `target`: what its stop rule reads

    def __post_init__(self) -> None:
        request = Request(RequestId(self.request_id), list(self.prompt), self.sampling, arrival_s=0.0)
        self.seq = Sequence(request, self.target, list(self.prompt), len(self.prompt))

    @property
    def generated(self) -> list[int]:
        return [t.token_id for t in self.tokens]


class SpeculativeRun:
    """Steps a set of Decodes on a LocalExecutor until each ends (stop token, EOS, max_tokens), pages from a
    simple counter (`first_page` on)."""

    def __init__(self, executor: Any, decodes: list[Decode], first_page: int = 0) -> None:
        self.executor = executor
        self.decodes = {d.request_id: d for d in decodes}
        self.next_page = first_page
        self.steps = 0
        for d in decodes:
            d.tables = d.tables or [[] for _ in range(executor.model(d.target).member.num_layers)]
            if d.drafter is not None:
                d.draft_tables = d.draft_tables or [[] for _ in range(executor.model(d.drafter).member.num_layers)]

    def _grow(self, tables: list[list[PageId]], member: str, positions: int) -> None:
        blocks = -(-positions // self.executor.tokens_per_block(member))
        for table in tables:
            while len(table) < blocks:
                if self.next_page >= self.executor.num_pages:
                    raise RuntimeError("SpeculativeRun: the arena ran out of pages")
                table.append(PageId(self.next_page))
                self.next_page += 1

    def chunk(self, d: Decode) -> SeqChunk:
        sequence = d.prompt + d.generated
        if d.target_done < len(d.prompt):
            self._grow(d.tables, d.target, len(d.prompt))
            return SeqChunk(request_id=RequestId(d.request_id), token_ids=d.prompt[d.target_done:],
                            start_pos=d.target_done, block_tables=d.tables, sample=True, sampling=d.sampling,
                            num_generated=0)
        start = len(sequence) - 1
        k = min(d.k, d.sampling.max_tokens - len(d.tokens) - 1) if d.drafter is not None else 0
        draft = None
        if k > 0:
            self._grow(d.draft_tables, d.drafter, start + k)
            draft = DraftSpec(member=d.drafter, num_tokens=k, token_ids=sequence[d.draft_done:],
                              start_pos=d.draft_done, block_tables=d.draft_tables)
        self._grow(d.tables, d.target, start + 1 + k)
        return SeqChunk(request_id=RequestId(d.request_id), token_ids=[sequence[-1]], start_pos=start,
                        block_tables=d.tables, sample=True, sampling=d.sampling, num_generated=len(d.tokens),
                        draft=draft)

    def plan(self) -> StepPlan:
        batches: dict[str, list[SeqChunk]] = {}
        for d in self.decodes.values():
            if not d.finished:
                batches.setdefault(d.target, []).append(self.chunk(d))
        return StepPlan(batches=[MemberBatch(member, chunks) for member, chunks in batches.items()])

    def step(self) -> None:
        plan = self.plan()
        sampled = self.executor.execute(plan)
        self.steps += 1
        returned: dict[str, list[SampledToken]] = {}
        for token in sampled:
            returned.setdefault(token.request_id, []).append(token)
        for batch in plan.batches:
            for chunk in batch.chunks:
                self._apply(self.decodes[chunk.request_id], chunk, returned.get(chunk.request_id, []))

    def _apply(self, d: Decode, chunk: SeqChunk, tokens: list[SampledToken]) -> None:
        accepted = len(tokens) - 1
        d.target_done = chunk.start_pos + len(chunk.token_ids) + max(0, accepted)
        if chunk.draft is not None:
            spec = chunk.draft
            d.draft_done = min(chunk.start_pos + 1 + accepted,
                               spec.start_pos + len(spec.token_ids) + spec.num_tokens - 1)
        member = self.executor.model(d.target).member
        for i, token in enumerate(tokens):
            d.tokens.append(token)
            d.seq.append_token(token.token_id, token.logprob)
            if d.seq.stop_reason(token.token_id, member.eos_token_ids, member.context_tokens) is not None:
                d.finished = True
                d.dropped += len(tokens) - i - 1
                break
        if chunk.draft is not None:
            d.verified.append((chunk.draft.num_tokens, len(tokens), d.finished))

    def run(self) -> None:
        while not all(d.finished for d in self.decodes.values()):
            self.step()


def workload_prompts(tokenizer_hash: str, count: int = 10, max_tokens: int = 256) -> list[list[int]]:
    """The first turns of the shipped quick trace (eval/workloads.py's format), at most max_tokens each."""
    from eval.workloads import load_trace

    trace = load_trace(TRACE, tokenizer_hash)
    prompts = [s.turns[0].user_token_ids or s.turns[0].prompt_token_ids for s in trace.sessions]
    return [p[-max_tokens:] for p in prompts[:count]]


def acceptance_stats(decodes: list[Decode]) -> dict[str, Any]:
    """Per-token acceptance over the verify steps that did not end their request (a stop cuts the tokens a
    step returns): accepted drafts / drafts the target judged (all accepted ones, plus one per step that
    rejected), and per draft position the share of steps reaching it that accepted it."""
    steps = [(k, returned - 1) for d in decodes for k, returned, ended in d.verified if not ended]
    accepted = sum(n for _, n in steps)
    judged = accepted + sum(n < k for k, n in steps)
    longest = max((k for k, _ in steps), default=0)
    by_position = []
    for i in range(1, longest + 1):
        reached = [n for k, n in steps if k >= i and n >= i - 1]
        by_position.append(round(sum(n >= i for n in reached) / len(reached), 4) if reached else None)
    return {"per_token_acceptance": round(accepted / judged, 4) if judged else None,
            "verify_steps": len(steps), "drafted": sum(k for k, _ in steps), "accepted": accepted,
            "tokens_per_step": round((accepted + len(steps)) / len(steps), 3) if steps else None,
            "by_position": by_position}


def draft_pairs(family) -> list[tuple[str, str]]:
    """(drafter, target): every smaller member for every larger one."""
    names = family.member_names
    return [(names[i], names[j]) for j in range(len(names)) for i in range(j)]


def measure_acceptance(executor, family, prompts: list[list[int]], k: int = DRAFT_TOKENS,
                       new_tokens: int = NEW_TOKENS, temperatures=TEMPERATURES, seed: int = 0) -> list[dict]:
    """Every pair and temperature: each prompt decoded new_tokens with drafts of k tokens (unseeded sampling
    from fixed per-request streams, so the table is reproducible)."""
    rows = []
    for drafter, target in draft_pairs(family):
        for temperature in temperatures:
            decodes = [Decode(f"{drafter}>{target}@{temperature}/{i}", prompt, target,
                              SamplingParams(max_tokens=new_tokens, temperature=temperature), drafter, k)
                       for i, prompt in enumerate(prompts)]
            for i, d in enumerate(decodes):
                executor.sampler.start_stream(RequestId(d.request_id), seed * 1000 + i)
            SpeculativeRun(executor, decodes).run()
            executor.release([RequestId(d.request_id) for d in decodes])
            rows.append({"draft": drafter, "target": target, "temperature": temperature, "k": k,
                         "prompts": len(prompts), **acceptance_stats(decodes)})
    return rows


def _cost_plan(executor, drafter: str, target: str, k: int, batch: int, context: int, drafting: bool,
               own: int = 0) -> StepPlan:
    """batch decodes of `target` at `context`, each drafting k tokens with `drafter` (or none), after `own`
    decodes of the drafter's own requests at the same context; pages per request from a counter (their contents
    do not change the time)."""
    next_page = 0

    def tables(member: str, positions: int) -> list[list[PageId]]:
        nonlocal next_page
        blocks = -(-positions // executor.tokens_per_block(member))
        out = []
        for _ in range(executor.model(member).member.num_layers):
            out.append([PageId(p % executor.num_pages) for p in range(next_page, next_page + blocks)])
            next_page += blocks
        return out
    chunks = []
    for i in range(batch):
        draft = (DraftSpec(member=drafter, num_tokens=k, token_ids=[5], start_pos=context,
                           block_tables=tables(drafter, context + k)) if drafting else None)
        chunks.append(SeqChunk(request_id=RequestId(f"cost{i}"), token_ids=[5], start_pos=context,
                               block_tables=tables(target, context + 1 + k), sample=True,
                               sampling=SamplingParams(max_tokens=context), num_generated=8, draft=draft))
    own_chunks = [SeqChunk(request_id=RequestId(f"own{i}"), token_ids=[5], start_pos=context,
                           block_tables=tables(drafter, context + 1), sample=True,
                           sampling=SamplingParams(max_tokens=context), num_generated=8) for i in range(own)]
    return StepPlan(batches=([MemberBatch(drafter, own_chunks)] if own_chunks else []) + [MemberBatch(target, chunks)])


def _median_ms(fn, repeats: int = REPEATS) -> float:
    fn()                                       # warm-up: allocations, caches, the native kernels
    runs = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        runs.append((time.perf_counter() - started) * 1e3)
    return round(statistics.median(runs), 3)


def measure_costs(executor, family, ks=COST_K, batches=COST_BATCH, context: int = COST_CONTEXT) -> list[dict]:
    """Per pair, k and batch: the draft phase (catch-up plus k - 1 draft decodes), the whole step (drafts,
    the target's k + 1 rows per request, acceptance), verify = step - draft, and the target's plain decode
    step at the same batch and context. With the drafter's own batch of as many decodes in the step, the members
    run as an independent family's (no nested merge): ride_step_ms with that batch in the drafts' catch-up
    forward (speculation.drafts_ride), apart_step_ms in a forward of its own (what the simulator's
    cost_model.ride_catch_ups saves: apart - ride)."""
    sync = _synchronizer(executor)
    rows = []
    for drafter, target in draft_pairs(family):
        for batch in batches:
            plain = _cost_plan(executor, drafter, target, 0, batch, context, drafting=False)
            plain_ms = _median_ms(lambda: sync(executor.execute(plain)))
            for k in ks:
                plan = _cost_plan(executor, drafter, target, k, batch, context, drafting=True)
                draft_ms = _median_ms(lambda: sync(executor.run_drafts(plan.batches)[0]))
                step_ms = _median_ms(lambda: sync(executor.execute(plan)))
                rows.append({"draft": drafter, "target": target, "k": k, "batch": batch, "context": context,
                             "draft_ms": draft_ms, "verify_ms": round(max(0.0, step_ms - draft_ms), 3),
                             "step_ms": step_ms, "plain_step_ms": plain_ms,
                             **_riding_ms(executor, sync, drafter, target, k, batch, context)})
    return rows


def _riding_ms(executor, sync, drafter: str, target: str, k: int, batch: int, context: int) -> dict[str, float]:
    mixed = _cost_plan(executor, drafter, target, k, batch, context, drafting=True, own=batch)
    nested, ride = executor.nested_pairs, executor.drafts_ride
    executor.nested_pairs = set()
    try:
        out = {}
        for key, rides in (("ride_step_ms", True), ("apart_step_ms", False)):
            executor.drafts_ride = rides
            out[key] = _median_ms(lambda: sync(executor.execute(mixed)))
        return out
    finally:
        executor.nested_pairs, executor.drafts_ride = nested, ride


def _synchronizer(executor):
    """Waits for the device's queued work (CUDA runs asynchronously), so a timed call ends when its work does."""
    import torch

    if executor.device.type == "cuda":
        return lambda _result: torch.cuda.synchronize(executor.device)
    return lambda _result: None


def build_executor(family, device: str, dtype: str, page_bytes: int = 16384):
    """The engine as serving builds it on this machine (on a CPU: every core but one for torch's threads)."""
    from engines.local.executor import LocalExecutor
    from orchestrator.serve.local_engine import engine_threads

    return LocalExecutor(family, num_pages=ARENA_PAGES, page_bytes=page_bytes, dtype=dtype, device=device,
                         num_threads=engine_threads(None) if device == "cpu" else None)


def measure(family_name: str = "tiny", device: str = "cpu", dtype: str = "float32", costs: bool = False,
            prompts: int = 10, new_tokens: int = NEW_TOKENS, ks=COST_K, batches=COST_BATCH) -> dict[str, Any]:
    family = load_family(family_name)
    executor = build_executor(family, device, dtype)
    started = time.perf_counter()
    texts = workload_prompts(family.members[0].tokenizer_hash, prompts)
    source = f"first turns of {TRACE.relative_to(TRACE.parents[3])} ({len(texts)} prompts, last 256 tokens at most)"
    table: dict[str, Any] = {
        "format": TABLE_FORMAT,
        "source": f"measured: local engine, {family.name} family, {dtype}, {device} "
                  f"({platform.machine()}), {time.strftime('%Y-%m-%d')}",
        "workload": f"{source}, {new_tokens} new tokens each (fewer where EOS ends the reply)",
        "acceptance": measure_acceptance(executor, family, texts, new_tokens=new_tokens),
        "costs": measure_costs(executor, family, ks, batches) if costs else None,
        "notes": [f"acceptance: k = {DRAFT_TOKENS} drafts a step; per_token_acceptance = accepted drafts / drafts "
                  "judged (the accepted ones plus the first rejected of each step); by_position: the share of "
                  "steps reaching draft i that kept it; temperature 1 draws from fixed per-request streams",
                  COSTS_NOTE if costs else "costs: not measured (--costs)"]}
    table["notes"].append(f"measured in {time.perf_counter() - started:.0f} s")
    return table


def print_table(table: dict[str, Any]) -> None:
    print(f"{'draft':>8} {'target':>8} {'temp':>5} {'accept':>7} {'tok/step':>8}  by position")
    for row in table["acceptance"]:
        print(f"{row['draft']:>8} {row['target']:>8} {row['temperature']:>5} "
              f"{row['per_token_acceptance']:>7} {row['tokens_per_step']:>8}  {row['by_position']}")
    if table["costs"]:
        print(f"\n{'draft':>8} {'target':>8} {'k':>2} {'batch':>5} {'draft ms':>9} {'verify ms':>9} {'step ms':>8} "
              f"{'plain ms':>8} {'ride ms':>8} {'apart ms':>8}")
        for row in table["costs"]:
            print(f"{row['draft']:>8} {row['target']:>8} {row['k']:>2} {row['batch']:>5} {row['draft_ms']:>9} "
                  f"{row['verify_ms']:>9} {row['step_ms']:>8} {row['plain_step_ms']:>8} {row['ride_step_ms']:>8} "
                  f"{row['apart_step_ms']:>8}")


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(",") if part.strip())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eval.simulate.measure_speculation",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", default="tiny")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--costs", action="store_true",
                        help="also time the draft and verify steps (wall clock: run it on a machine of its own)")
    parser.add_argument("--prompts", type=int, default=10, help="workload prompts decoded per pair and temperature")
    parser.add_argument("--new-tokens", type=int, default=NEW_TOKENS)
    parser.add_argument("--cost-k", default=",".join(map(str, COST_K)), help="drafted tokens timed (comma list)")
    parser.add_argument("--cost-batch", default=",".join(map(str, COST_BATCH)), help="batch sizes timed (comma list)")
    parser.add_argument("--out", default=None,
                        help="the table to write (default: eval/simulate/tables/<family>_speculation.json, what "
                             "mfs simulate reads for that family)")
    args = parser.parse_args(argv)
    table = measure(args.family, args.device, args.dtype, args.costs, args.prompts, args.new_tokens,
                    ks=_ints(args.cost_k), batches=_ints(args.cost_batch))
    out = Path(args.out) if args.out else speculation_table_path(load_family(args.family).name)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(table, indent=1) + "\n")
    print_table(table)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
