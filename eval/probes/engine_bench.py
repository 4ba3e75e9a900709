"""Decode throughput of the local engine vs transformers generate() on the largest member, with achieved FLOP/s."""
from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from engines.local.executor import LocalExecutor
from orchestrator.core.family import SHIPPED_FAMILIES_DIR, MemberSpec, load_family
from orchestrator.core.types import MemberBatch, PageId, RequestId, SamplingParams, SeqChunk, StepPlan

BATCH_SIZES = (1, 8, 32)
BLOCK_TOKENS = 16


@dataclass(slots=True)
class BenchRow:
    batch: int
    engine_tokens_per_s: float
    engine_step_ms: float
    hf_tokens_per_s: float
    hf_step_ms: float
    ratio: float
    engine_cpu_step_ms: float       # thread CPU time: what the step costs when the shared machine is busy
    hf_cpu_step_ms: float
    engine_gflop_per_s: float


def _prompts(batch: int, prompt_tokens: int, vocab: int) -> list[list[int]]:
    return [[(31 * i + 17 * b + 5) % (vocab - 3) + 3 for i in range(prompt_tokens)] for b in range(batch)]


def engine_step_times_s(executor: LocalExecutor, member: MemberSpec, prompts: list[list[int]],
                        new_tokens: int) -> tuple[list[float], float]:
    """Prefills all prompts in one step (untimed), then times the new_tokens - 1 decode steps:
    (wall seconds per step, total thread CPU seconds)."""
    block = executor.tokens_per_block(member.name)
    blocks_per_seq = -(-(len(prompts[0]) + new_tokens) // block)
    tables, next_page = [], 0
    for _ in prompts:
        tables.append([[PageId(next_page + l * blocks_per_seq + b) for b in range(blocks_per_seq)]
                       for l in range(member.num_layers)])
        next_page += member.num_layers * blocks_per_seq
    greedy = SamplingParams(max_tokens=new_tokens)

    def step(tokens: list[list[int]], start: int) -> list[int]:
        chunks = [SeqChunk(request_id=RequestId(f"b{i}"), token_ids=t, start_pos=start, block_tables=tables[i],
                           sample=True, sampling=greedy) for i, t in enumerate(tokens)]
        return [s.token_id for s in executor.execute(StepPlan(batches=[MemberBatch(member.name, chunks)]))]

    last = step(prompts, 0)
    position, times = len(prompts[0]), []
    cpu_began = time.thread_time()
    for _ in range(new_tokens - 1):
        began = time.perf_counter()
        last = step([[t] for t in last], position)
        times.append(time.perf_counter() - began)
        position += 1
    return times, time.thread_time() - cpu_began


def hf_step_time_s(model, prompts: list[list[int]], new_tokens: int) -> tuple[float, float]:
    """(wall, thread CPU) seconds per decode step: (generate N tokens - generate 1) / (N - 1), so prefill cancels."""
    ids = torch.tensor(prompts)

    def generate_s(count: int) -> tuple[float, float]:
        wall_began, cpu_began = time.perf_counter(), time.thread_time()
        with torch.no_grad():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=count, min_new_tokens=count,
                           do_sample=False, use_cache=True)
        return time.perf_counter() - wall_began, time.thread_time() - cpu_began

    (long_wall, long_cpu), (short_wall, short_cpu) = generate_s(new_tokens), generate_s(1)
    return (long_wall - short_wall) / (new_tokens - 1), (long_cpu - short_cpu) / (new_tokens - 1)


def matmul_flop_per_s(size: int = 512, repeats: int = 20) -> float:
    a, b = torch.randn(size, size), torch.randn(size, size)
    best_s = min(_timed(lambda: a @ b) for _ in range(repeats))
    return 2 * size ** 3 / best_s


def _timed(fn) -> float:
    began = time.perf_counter()
    fn()
    return time.perf_counter() - began


def flop_per_token(member: MemberSpec, intermediate: int, context_tokens: float) -> float:
    """2 * matmul params (layers + lm_head) + attention (QK^T and PV over the context)."""
    d, h, kv = member.hidden_size, member.num_heads * member.head_dim, member.num_kv_heads * member.head_dim
    per_layer = d * (h + 2 * kv) + h * d + 3 * d * intermediate
    params = member.num_layers * per_layer + member.vocab_size * d
    attention = 4 * member.num_layers * h * context_tokens
    return 2 * params + attention


def main(argv: list[str] | None = None) -> list[BenchRow]:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--family", type=Path, default=SHIPPED_FAMILIES_DIR / "tiny", help="family dir (default: shipped tiny)")
    parser.add_argument("--tokens", type=int, default=64, help="new tokens per request")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1, help="torch threads for both sides")
    parser.add_argument("--rounds", type=int, default=2, help="alternating engine/HF rounds; best kept")
    parser.add_argument("--malloc-mmap-threshold-mb", type=int, default=32,
                        help="the engine's glibc malloc setting (developer.malloc_mmap_threshold_mb; process-wide, so "
                             "transformers runs under it too; 0 = glibc defaults)")
    parser.add_argument("--torch-attention", action="store_true",
                        help="the engine's decode attention as gather + SDPA (developer.native_attention: false)")
    parser.add_argument("--torch-layer-ops", action="store_true",
                        help="RMSNorm, rope + K/V write and SiLU-and-multiply as torch operators "
                             "(developer.native_layer_ops: false)")
    parser.add_argument("--parallel-forwards", type=int, choices=(1, 2), default=1,
                        help="the engine's forwards per step (developer.parallel_forwards); the engine then runs "
                             "threads/K intra-op threads per forward, so both sides use --threads cores in all "
                             "(2 with --threads 2 is how `mfs serve` runs the engine on 2 cores)")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = parser.parse_args(argv)
    if args.threads % args.parallel_forwards:
        parser.error(f"--threads {args.threads} is not a multiple of --parallel-forwards {args.parallel_forwards}")
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    family = load_family(args.family)
    member = family.members[-1]
    page_bytes = BLOCK_TOKENS * member.kv_bytes_per_token_per_layer(4)
    blocks = -(-(args.prompt_tokens + args.tokens) // BLOCK_TOKENS)
    executor = LocalExecutor(family, num_pages=max(BATCH_SIZES) * member.num_layers * blocks, page_bytes=page_bytes,
                             num_threads=args.threads // args.parallel_forwards,
                             malloc_mmap_threshold_mb=args.malloc_mmap_threshold_mb,
                             native_attention=not args.torch_attention, parallel_forwards=args.parallel_forwards,
                             native_layer_ops=not args.torch_layer_ops)
    hf = AutoModelForCausalLM.from_pretrained(member.checkpoint_dir, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    intermediate = executor.model(member.name).config.intermediate_size
    machine = matmul_flop_per_s()
    print(f"family {family.name} member {member.name}: {member.num_layers} layers, hidden {member.hidden_size}, "
          f"prompt {args.prompt_tokens} + {args.tokens} new tokens, fp32, {args.threads} thread(s) "
          f"(engine: {args.parallel_forwards} forward(s) x {args.threads // args.parallel_forwards}), "
          f"malloc mmap threshold {args.malloc_mmap_threshold_mb} MB (both sides; tuned: {executor.malloc_tuned}); "
          f"decode attention {'native, in place' if executor.decode_kernel else 'gather + SDPA'}; "
          f"layer ops {'native' if executor.layer_kernels else 'torch'}")
    print(f"machine matmul: {machine / 1e9:.1f} GFLOP/s")
    print(f"{'batch':>5} {'engine tok/s':>13} {'step ms':>8} {'HF tok/s':>10} {'HF step ms':>10} {'ratio':>6} "
          f"{'cpu ms':>7} {'HF cpu ms':>9} {'cpu ratio':>9} {'GFLOP/s':>8} {'of peak':>7}")
    rows = []
    for batch in BATCH_SIZES:
        prompts = _prompts(batch, args.prompt_tokens, member.vocab_size)
        engine_runs, hf_runs = [], []
        for _ in range(args.rounds):               # alternate so both sides see the same machine load
            torch.set_num_threads(args.threads // args.parallel_forwards)   # torch's count is process-wide
            engine_runs.append(engine_step_times_s(executor, member, prompts, args.tokens))
            torch.set_num_threads(args.threads)
            hf_runs.append(hf_step_time_s(hf, prompts, args.tokens))
        best = min((wall for wall, _ in engine_runs), key=sum)
        engine_cpu_step = min(cpu for _, cpu in engine_runs) / (args.tokens - 1)
        engine_tps = batch * len(best) / sum(best)
        hf_step, hf_cpu_step = min(wall for wall, _ in hf_runs), min(cpu for _, cpu in hf_runs)
        context = args.prompt_tokens + args.tokens / 2
        achieved = engine_tps * flop_per_token(member, intermediate, context)
        row = BenchRow(batch=batch, engine_tokens_per_s=engine_tps, engine_step_ms=statistics.median(best) * 1e3,
                       hf_tokens_per_s=batch / hf_step, hf_step_ms=hf_step * 1e3,
                       ratio=engine_tps * hf_step / batch, engine_cpu_step_ms=engine_cpu_step * 1e3,
                       hf_cpu_step_ms=hf_cpu_step * 1e3, engine_gflop_per_s=achieved / 1e9)
        rows.append(row)
        print(f"{batch:>5} {row.engine_tokens_per_s:>13.0f} {row.engine_step_ms:>8.2f} {row.hf_tokens_per_s:>10.0f} "
              f"{row.hf_step_ms:>10.2f} {row.ratio:>6.2f} {row.engine_cpu_step_ms:>7.2f} {row.hf_cpu_step_ms:>9.2f} "
              f"{row.hf_cpu_step_ms / row.engine_cpu_step_ms:>9.2f} {row.engine_gflop_per_s:>8.2f} "
              f"{achieved / machine:>7.1%}")
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=2))
    return rows


if __name__ == "__main__":
    main()
