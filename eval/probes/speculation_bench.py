"""Nested self-speculation on the local engine: tokens per second of greedy decodes pinned to one member, with
0 / 1 / 2 drafted tokens a step, at a given number of requests decoding at once; checks the tokens are
identical. `python -m eval.probes.speculation_bench --member tiny-l --concurrency 1,2,4,8`."""
from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path

from engines.local.executor import LocalExecutor
from eval.bench.driver import pinned_request
from orchestrator.core.complexity import ComplexityEstimator
from orchestrator.core.config import load_config
from orchestrator.core.engine_core import EngineCore
from orchestrator.core.family import load_family
from orchestrator.serve.tokenizer import FamilyTokenizer
from orchestrator.sharegpt import iter_conversations


def sharegpt_prompts(tokenizer: FamilyTokenizer, count: int, max_tokens: int, skip: int = 300) -> list[list[int]]:
    """First user turns of ShareGPT conversations (past the training part's start) as chat prompts."""
    prompts = []
    for conversation in itertools.islice(iter_conversations(), skip, None):
        ids = tokenizer.apply_chat_template(conversation.messages[:1])
        if len(ids) <= max_tokens:
            prompts.append(ids)
        if len(prompts) == count:
            return prompts
    raise RuntimeError(f"only {len(prompts)} ShareGPT prompts of at most {max_tokens} tokens")


def run(family_name: str, member: str, prompts: list[list[int]], concurrency: int, new_tokens: int,
        drafts: int) -> tuple[dict[int, list[int]], float, int]:
    """Serves the prompts with at most `concurrency` in flight; returns (tokens per prompt, seconds, steps)."""
    config = load_config(overrides={"family": family_name, "pool.num_pages": 4096,
                                    "scheduler.self_speculation_tokens": drafts,
                                    "scheduler.self_speculation_max_decodes": max(concurrency, 1)})
    family = load_family(config.family)
    core = EngineCore(config, family, ComplexityEstimator(()), time.monotonic)
    core.executor = LocalExecutor(family, config.num_arena_pages(), config.pool.page_bytes, num_threads=1)
    tokens: dict[int, list[int]] = {}
    pending = list(enumerate(prompts))

    def submit() -> None:
        index, prompt = pending.pop(0)
        tokens[index] = []
        core.add_request(pinned_request(f"r{index}", member, new_tokens, prompt),
                         lambda out, index=index: tokens[index].extend(out.new_token_ids))

    began, steps = time.perf_counter(), 0
    while pending or core.has_work():
        in_flight = sum(len(t) < new_tokens for t in tokens.values())
        while pending and in_flight < concurrency:
            submit()
            in_flight += 1
        core.step()
        steps += 1
    return tokens, time.perf_counter() - began, steps


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", default="tiny")
    parser.add_argument("--member", default="tiny-l")
    parser.add_argument("--concurrency", default="1,2,4,8", help="requests decoding at once (comma-separated)")
    parser.add_argument("--drafts", default="0,1,2", help="drafted tokens a step (comma-separated; 0 first)")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2, help="each setting this many times, interleaved")
    parser.add_argument("--out", type=Path, default=None, help="JSON of every run")
    args = parser.parse_args(argv)
    family = load_family(args.family)
    if args.member not in family.member_names:
        parser.error(f"--member {args.member!r} is not in family {family.name} ({', '.join(family.member_names)})")
    drafts = [int(d) for d in args.drafts.split(",")]
    if drafts[0] != 0:
        parser.error("--drafts must start with 0 (the reference the others' tokens are checked against)")
    prompts = sharegpt_prompts(FamilyTokenizer(family.members[0].checkpoint_dir), args.prompts, 500)
    rows = []
    print(f"{'conc':>4} {'drafts':>6} {'tok/s':>8} {'tokens/step':>11} identical")
    for concurrency in (int(c) for c in args.concurrency.split(",")):
        for repeat in range(args.repeats):
            reference = None
            for k in drafts:
                tokens, seconds, steps = run(args.family, args.member, prompts, concurrency, args.new_tokens, k)
                reference = tokens if reference is None else reference
                total = sum(len(t) for t in tokens.values())
                same = sum(tokens[i] == reference[i] for i in reference)
                rows.append({"concurrency": concurrency, "drafts": k, "repeat": repeat, "tokens_per_s": total / seconds,
                             "tokens_per_step": total / steps, "identical": same, "prompts": len(reference)})
                print(f"{concurrency:>4} {k:>6} {total / seconds:>8.0f} {total / steps:>11.2f} {same}/{len(reference)}",
                      flush=True)
    if args.out is not None:
        args.out.write_text(json.dumps({"member": args.member, "new_tokens": args.new_tokens, "runs": rows}, indent=1))


if __name__ == "__main__":
    main()
