"""Cost of a nested escalation handover against a full prefill on the target member.

A request escalating from tiny-s (or tiny-m) to tiny-l in the nested tiny family keeps the source's
pages for the shared lower layers and its residual stream at the exit depth, so the target computes
only its upper layers. This times both prefills on the real local engine.

    python -m eval.probes.handover_bench [--family tiny] [--tokens 512] [--repeats 5]
"""
from __future__ import annotations

import argparse
import itertools
import time

from orchestrator.core.family import load_family
from orchestrator.core.types import MemberBatch, MemberName, PageId, RequestId, SamplingParams, SeqChunk, StepPlan

PAGE_BYTES = 16384


class _Pages:
    def __init__(self) -> None:
        self._next = itertools.count()

    def take(self, n: int) -> list[PageId]:
        return [PageId(next(self._next)) for _ in range(n)]


def _chunk(rid: str, tokens: list[int], tables, start_layer=0, residual_in=None, residual_out=None) -> SeqChunk:
    return SeqChunk(request_id=RequestId(rid), token_ids=tokens, start_pos=0, block_tables=tables, sample=True,
                    sampling=SamplingParams(max_tokens=1), start_layer=start_layer, residual_table=residual_in,
                    residual_table_out=residual_out)


def time_plan(executor, member: str, chunk: SeqChunk, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        executor.execute(StepPlan(batches=[MemberBatch(MemberName(member), [chunk])]))
        best = min(best, time.perf_counter() - started)
    return best


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", default="tiny")
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)

    from engines.local.executor import LocalExecutor

    family = load_family(args.family)
    target = family.members[-1]
    block = target.tokens_per_block(PAGE_BYTES, 4)
    num_blocks = -(-args.tokens // block)
    tokens = [(7 * i + 11) % target.vocab_size for i in range(args.tokens)]
    executor = LocalExecutor(family, num_pages=num_blocks * (target.num_layers + 2) * len(family.members) + 8,
                             page_bytes=PAGE_BYTES)
    pages = _Pages()
    full_tables = [pages.take(num_blocks) for _ in range(target.num_layers)]
    full_s = time_plan(executor, target.name, _chunk("full", tokens, full_tables), args.repeats)
    print(f"prefill of {args.tokens} tokens on {target.name} ({target.num_layers} layers): full {full_s * 1e3:.1f} ms")
    for source in family.members[:-1]:
        depth = family.shared_depth(source.name, target.name)
        if depth != source.num_layers:
            print(f"  from {source.name}: not nested in {target.name}, no layer reuse")
            continue
        source_tables = [pages.take(num_blocks) for _ in range(source.num_layers)]
        residual = pages.take(num_blocks)
        executor.execute(StepPlan(batches=[MemberBatch(MemberName(source.name),
                                                       [_chunk("src", tokens, source_tables, residual_out=residual)])]))
        upper = [pages.take(num_blocks) for _ in range(target.num_layers - depth)]
        handover = _chunk("handover", tokens, source_tables + upper, start_layer=depth, residual_in=residual)
        handover_s = time_plan(executor, target.name, handover, args.repeats)
        print(f"  handover from {source.name} (start at layer {depth}): {handover_s * 1e3:.1f} ms = "
              f"{handover_s / full_s:.0%} of the full prefill; computes {target.num_layers - depth}/{target.num_layers} "
              f"layers and reuses {depth * num_blocks} shared pages + {num_blocks} residual pages")


if __name__ == "__main__":
    main()
