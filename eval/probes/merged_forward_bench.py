"""One decode step with N requests on every member of a nested family: a forward per member against
ONE merged forward over the shared lower layers (LocalExecutor merge_nested). CPU time, best of R.

    python -m eval.probes.merged_forward_bench [--family tiny] [--requests 8] [--prompt 64] [--repeats 5]
"""
from __future__ import annotations

import argparse
import itertools
import time

import torch

from orchestrator.core.family import load_family
from orchestrator.core.types import MemberBatch, MemberName, PageId, RequestId, SamplingParams, SeqChunk, StepPlan

PAGE_BYTES = 16384


def time_step(family, merge: bool, requests: int, prompt: int, repeats: int) -> tuple[float, list[int]]:
    from engines.local.executor import LocalExecutor

    num_pages = sum(m.num_layers for m in family.members) * requests * (-(-(prompt + 8) // 16))
    executor = LocalExecutor(family, num_pages, PAGE_BYTES, merge_nested=merge)
    pages = itertools.count()
    seqs = []   # (member, request id, block tables, prompt tokens)
    for member in family.members:
        num_blocks = -(-(prompt + 8) // executor.tokens_per_block(member.name))
        for i in range(requests):
            tables = [[PageId(next(pages)) for _ in range(num_blocks)] for _ in range(member.num_layers)]
            tokens = [(7 * i + j) % 200 + 3 for j in range(prompt)]
            seqs.append((member.name, f"{member.name}-{i}", tables, tokens))

    def plan(decode: bool) -> StepPlan:
        return StepPlan(batches=[MemberBatch(MemberName(m.name), [
            SeqChunk(RequestId(rid), [5] if decode else tokens, prompt if decode else 0, tables, True, SamplingParams())
            for name, rid, tables, tokens in seqs if name == m.name]) for m in family.members])

    executor.execute(plan(decode=False))
    best, tokens = float("inf"), []
    for _ in range(repeats):
        step = plan(decode=True)
        started = time.process_time()
        out = executor.execute(step)
        best = min(best, time.process_time() - started)
        tokens = [s.token_id for s in out]
    return best, tokens


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", default="tiny")
    parser.add_argument("--requests", type=int, default=8, help="decoding requests per member")
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    family = load_family(args.family)
    separate_s, separate_tokens = time_step(family, False, args.requests, args.prompt, args.repeats)
    merged_s, merged_tokens = time_step(family, True, args.requests, args.prompt, args.repeats)
    print(f"{args.requests} decoding requests on each of {', '.join(family.member_names)} (prompt {args.prompt}, "
          f"{args.threads} thread): separate forwards {separate_s * 1e3:.2f} ms, merged {merged_s * 1e3:.2f} ms, "
          f"{separate_s / merged_s:.2f}x; tokens identical: {separate_tokens == merged_tokens}")


if __name__ == "__main__":
    main()
