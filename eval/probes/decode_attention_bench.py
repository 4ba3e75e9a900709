"""Decode attention and step shape of the local engine, in process (its levers, measured one at a time):

1. attention of one layer for N decoding sequences, the native kernel (keys read in place) against gather +
   SDPA, over an arena of served size with every layer's pages at different places (so the keys come from
   DRAM, as in a serving engine; the same pages for every layer would sit in the L3 cache);
2. a whole tiny-l step (N decodes at that context, with or without a 128-token prefill chunk every other step)
   with one forward against two forwards on two threads (developer.parallel_forwards);
3. optionally (--profile) the step's torch operators by self CPU time (the kernel runs outside torch and is
   not listed), and the step's matmul shapes timed hot (weights in cache) against what they achieve in the step.

    python -m eval.probes.decode_attention_bench [--contexts 48,160,480] [--seqs 32] [--rounds 3] [--profile]

Every figure is a median of repetitions within one round, rounds interleaved; it prints, it asserts nothing.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from engines.local.attention import attend, decode_group
from engines.local.executor import LocalExecutor
from engines.local.paged_decode import PagedDecodeKernel
from orchestrator.core.family import SHIPPED_FAMILIES_DIR, load_family
from orchestrator.core.types import MemberBatch, PageId, RequestId, SamplingParams, SeqChunk, StepPlan

ARENA_PAGES = 8192              # 128 MB of 16 KB pages: larger than the L3 cache, as a served arena
PREFILL_TOKENS = 128


def _median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        fn()
        times.append(time.perf_counter() - began)
    return statistics.median(times) * 1e3


def attention_ms(kernel: PagedDecodeKernel, seqs: int, context: int, layers: int, repeats: int) -> dict[str, float]:
    """ms per layer: every layer's pages drawn afresh from the whole arena (tiny-l's shapes: 4 heads, 2 kv heads)."""
    block, kv_heads, heads, dim = 16, 2, 4, 64
    kv_view = torch.randn(ARENA_PAGES * 2 * block * kv_heads * dim).view(ARENA_PAGES, 2, block, kv_heads, dim)
    kv_rows = (kv_view[:, 0].flatten(1), kv_view[:, 1].flatten(1))
    blocks = -(-context // block)
    gen = torch.Generator().manual_seed(0)
    tables = torch.randperm(ARENA_PAGES, generator=gen)[:seqs * layers * blocks].view(seqs, layers, blocks)
    group = decode_group(list(range(seqs)), list(range(seqs)), tables, [context] * seqs, blocks, seqs, torch.float32)
    q = torch.randn(seqs, heads, dim, generator=gen)

    def all_layers(native: bool):
        return lambda: [attend(q, kv_rows, group, layer, kv_heads, dim, kv_view, kernel if native else None)
                        for layer in range(layers)]
    return {name: _median_ms(all_layers(native), repeats) / layers for name, native in (("native", True),
                                                                                        ("torch", False))}


def step_ms(executors: dict[int, LocalExecutor], member, seqs: int, context: int, prefill: bool,
            steps: int) -> dict[int, float]:
    """ms per step for each parallel_forwards setting: seqs decodes at `context` (+ a prefill every other step)."""
    block = executors[1].tokens_per_block(member.name)
    blocks = -(-max(context + 1, PREFILL_TOKENS) // block)
    tables = [[[PageId((s * member.num_layers + layer) * blocks + b) for b in range(blocks)]
               for layer in range(member.num_layers)] for s in range(seqs + 1)]
    greedy = SamplingParams(max_tokens=1)

    def plan(step: int) -> StepPlan:
        chunks = [SeqChunk(request_id=RequestId(f"d{i}"), token_ids=[5], start_pos=context, block_tables=tables[i],
                           sample=True, sampling=greedy) for i in range(seqs)]
        if prefill and step % 2 == 0:
            chunks.append(SeqChunk(request_id=RequestId(f"p{step}"), token_ids=list(range(3, 3 + PREFILL_TOKENS)),
                                   start_pos=0, block_tables=tables[seqs], sample=True, sampling=greedy))
        return StepPlan(batches=[MemberBatch(member.name, chunks)])
    out = {}
    for forwards, executor in executors.items():
        executor.execute(plan(0))
        began = time.perf_counter()
        for step in range(steps):
            executor.execute(plan(step))
        out[forwards] = (time.perf_counter() - began) / steps * 1e3
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eval.probes.decode_attention_bench", description=__doc__.split("\n")[0])
    parser.add_argument("--contexts", default="48,160,480", help="keys per sequence (comma-separated)")
    parser.add_argument("--seqs", type=int, default=32, help="decoding sequences")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--profile", action="store_true", help="also list the step's torch operators")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    contexts = [int(c) for c in args.contexts.split(",")]
    kernel = PagedDecodeKernel.load()
    if kernel is None:
        print("decode_attention_bench: the native kernel could not be built here (see the log line above)")
        return 1
    family = load_family(SHIPPED_FAMILIES_DIR / "tiny")
    member = family.members[-1]
    page_bytes = 16 * member.kv_bytes_per_token_per_layer(4)
    num_pages = (args.seqs + 1) * member.num_layers * -(-max(max(contexts) + 1, PREFILL_TOKENS) // 16)
    executors = {n: LocalExecutor(family, num_pages=num_pages, page_bytes=page_bytes, num_threads=1,
                                  parallel_forwards=n) for n in (1, 2)}
    print(f"{args.seqs} decoding sequences, 1 torch thread; attention: tiny-l shapes over a {ARENA_PAGES}-page arena")
    for round_index in range(args.rounds):
        for context in contexts:
            attn = attention_ms(kernel, args.seqs, context, member.num_layers, repeats=10)
            decode = step_ms(executors, member, args.seqs, context, prefill=False, steps=20)
            mixed = step_ms(executors, member, args.seqs, context, prefill=True, steps=20)
            print(f"round {round_index} keys {context:4d}: attention per layer native {attn['native']:.3f} ms, "
                  f"gather+SDPA {attn['torch']:.3f} ms | step, decodes only: 1 forward {decode[1]:.1f} ms, "
                  f"2 forwards {decode[2]:.1f} ms | with a {PREFILL_TOKENS}-token prefill every other step: "
                  f"{mixed[1]:.1f} / {mixed[2]:.1f} ms", flush=True)
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        context = contexts[len(contexts) // 2]
        plain = step_ms({1: executors[1]}, member, args.seqs, context, prefill=False, steps=20)[1]
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step_ms({1: executors[1]}, member, args.seqs, context, prefill=False, steps=10)
        averages = prof.key_averages()
        print(averages.table(sort_by="self_cpu_time_total", row_limit=12))
        # 11 steps ran under the profiler (step_ms runs one untimed step first)
        matmul_ms = sum(e.self_cpu_time_total for e in averages if e.key in ("aten::mm", "aten::addmm")) / 1e3 / 11
        print(f"keys {context}, decodes only: matmuls (aten::mm + aten::addmm) {matmul_ms:.1f} ms of CPU per step "
              f"against a {plain:.1f} ms step without the profiler ({matmul_ms / plain:.0%})")
        intermediate = executors[1].model(member.name).config.intermediate_size
        hot = hot_matmuls_us(member, intermediate, args.seqs)
        step_flop = sum(flop for _, flop, _ in hot.values()) - hot["head, [out, in] (F.linear)"][1]
        print(f"the same step's matmuls timed hot in a loop (weights in cache; the engine's [in, out] layout): "
              f"{sum(us for name, (us, _, _) in hot.items() if 'F.linear' not in name) / 1e3:.1f} ms "
              f"for {step_flop / 1e6:.0f} MFLOP; in the step: {step_flop / matmul_ms / 1e6:.1f} GFLOP/s")
        for name, (us, flop, count) in hot.items():
            print(f"  {name:28s} x{count}: {us / count:7.1f} us each, {flop / us / 1e3:5.1f} GFLOP/s")
    return 0


def hot_matmuls_us(member, intermediate: int, rows: int) -> dict[str, tuple[float, float, int]]:
    """One decode step's matmul shapes (rows x in @ in x out, the engine's [in, out] weights), each timed in a
    tight loop so its weights stay in cache: name -> (microseconds for all calls of the step, FLOP, calls).
    The head is also timed as F.linear on [out, in] weights, the layout transformers uses."""
    d, q = member.hidden_size, member.num_heads * member.head_dim
    kv = member.num_kv_heads * member.head_dim
    layers = member.num_layers
    shapes = {"qkv": (d, q + 2 * kv, layers), "o (+ residual)": (q, d, layers),
              "gate_up": (d, 2 * intermediate, layers), "down (+ residual)": (intermediate, d, layers),
              "head": (d, member.vocab_size, 1)}
    result = {}
    for name, (k, n, count) in shapes.items():
        x, w = torch.randn(rows, k), torch.randn(k, n)
        result[name] = (_median_ms(lambda: torch.mm(x, w), 200) * 1e3 * count, 2.0 * rows * k * n * count, count)
    w_out_in = torch.randn(member.vocab_size, d)
    x = torch.randn(rows, d)
    result["head, [out, in] (F.linear)"] = (_median_ms(lambda: torch.nn.functional.linear(x, w_out_in), 200) * 1e3,
                                            2.0 * rows * d * member.vocab_size, 1)
    return result


if __name__ == "__main__":
    raise SystemExit(main())
