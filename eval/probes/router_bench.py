"""Microbenchmark of the routing hot path: ComplexityEstimator.score + Router.route per request."""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from orchestrator.core.complexity import ComplexityEstimator
from orchestrator.core.config import RouterConfig
from orchestrator.core.events import percentile
from orchestrator.core.family import FamilySpec, MemberSpec
from orchestrator.core.router import MemberLoad, Router
from orchestrator.core.types import MemberName, Request, RequestId, SamplingParams

DEFAULT_VOCAB_SIZE = 32000
DEFAULT_PROMPT_TOKENS = 1000
DEFAULT_CALLS = 10_000
WARMUP_CALLS = 200
SEED = 0
CUE_WORDS = (" def", " return", " import", " {", ";", " why", " explain", " because", " step", " 42", " +", " =")
ROLE_WORDS = ("<|user|>", "<|assistant|>", "<|system|>")


@dataclass(frozen=True, slots=True)
class BenchResult:
    prompt_tokens: int
    members: int
    calls: int
    score_us_median: float
    route_us_median: float
    total_us_median: float
    total_us_p99: float


def synthetic_vocab(size: int) -> list[str]:
    """A vocab with role tokens, some cue words and plain filler, like a real BPE vocab's mix."""
    vocab = list(ROLE_WORDS) + list(CUE_WORDS)
    vocab += [f" w{i}" for i in range(size - len(vocab))]
    return vocab


def synthetic_family(names: tuple[str, ...] = ("tiny-s", "tiny-m", "tiny-l")) -> FamilySpec:
    members = tuple(
        MemberSpec(name=MemberName(name), index=i, checkpoint_dir=Path("/nonexistent") / name,
                   architecture="llama", num_layers=2 * (i + 1), hidden_size=64, num_heads=4, num_kv_heads=2,
                   head_dim=16, vocab_size=DEFAULT_VOCAB_SIZE, context_tokens=4096,
                   layer_lineages=tuple(f"lin{l}" for l in range(2 * (i + 1))), tokenizer_hash="bench",
                   eos_token_ids=(0,))
        for i, name in enumerate(names))
    return FamilySpec(name="bench", members=members)


def run(prompt_tokens: int = DEFAULT_PROMPT_TOKENS, calls: int = DEFAULT_CALLS,
        vocab_size: int = DEFAULT_VOCAB_SIZE) -> BenchResult:
    rng = random.Random(SEED)
    vocab = synthetic_vocab(vocab_size)
    estimator = ComplexityEstimator(vocab, role_token_ids=range(len(ROLE_WORDS)))
    family = synthetic_family()
    router = Router(family, RouterConfig())
    prompt = [rng.randrange(vocab_size) for _ in range(prompt_tokens)]
    prompt[0], prompt[-1] = 0, 1   # a user turn and the assistant header
    request = Request(request_id=RequestId("bench"), prompt_token_ids=prompt, sampling=SamplingParams(), arrival_s=0.0)
    names = family.member_names
    matched = {names[0]: prompt_tokens // 2, names[1]: prompt_tokens // 4, names[2]: 0}
    loads = {name: MemberLoad(num_running=4 * i, num_waiting=i, running_tokens=500 * i, queued_tokens=100 * i)
             for i, name in enumerate(names)}

    clock = time.perf_counter_ns
    score_ns, route_ns, total_ns = [], [], []
    for call in range(WARMUP_CALLS + calls):
        t0 = clock()
        complexity = estimator.score(prompt)
        t1 = clock()
        router.route(request, complexity=complexity, matched_prefix_tokens=matched, loads=loads,
                     session_member=names[1])
        t2 = clock()
        if call >= WARMUP_CALLS:
            score_ns.append(t1 - t0)
            route_ns.append(t2 - t1)
            total_ns.append(t2 - t0)
    total_ns.sort()
    return BenchResult(
        prompt_tokens=prompt_tokens, members=len(names), calls=calls,
        score_us_median=statistics.median(score_ns) / 1e3, route_us_median=statistics.median(route_ns) / 1e3,
        total_us_median=statistics.median(total_ns) / 1e3,
        total_us_p99=total_ns[min(len(total_ns) - 1, int(0.99 * len(total_ns)))] / 1e3)


def run_full_path(prompt_tokens: int = DEFAULT_PROMPT_TOKENS, calls: int = 2000, cached_blocks: int = 10_000,
                  vocab_size: int = DEFAULT_VOCAB_SIZE) -> dict[str, float]:
    """The whole per-request routing cost as the scheduler pays it: chained block hashes of the prompt,
    the cached-prefix estimate on every member against a pool holding `cached_blocks` cached blocks,
    the complexity score and the router's decision."""
    from orchestrator.core.block_hash import chain_block_hashes, hash_seed
    from orchestrator.core.config import load_config
    from orchestrator.core.kv_cache import KVCacheManager
    from orchestrator.core.page_pool import PagePool
    from orchestrator.core.scheduler import Scheduler
    from orchestrator.core.types import PageKey

    rng = random.Random(SEED)
    family = synthetic_family()
    config = load_config(overrides={"pool.page_bytes": 4096, "pool.host_tier_mb": 0})
    largest = family.members[-1]
    block = largest.tokens_per_block(config.pool.page_bytes, 4)
    pool = PagePool(cached_blocks * largest.num_layers + 4096, members=family.member_names)
    seed = hash_seed(largest.tokenizer_hash, None)
    prompt = [rng.randrange(vocab_size) for _ in range(prompt_tokens)]
    # half of the prompt is cached; the rest of the pool holds unrelated cached blocks
    filler = [rng.randrange(vocab_size) for _ in range(cached_blocks * block)]
    hashes = chain_block_hashes(prompt[: prompt_tokens // 2], block, seed)
    hashes += chain_block_hashes(filler, block, seed)[: cached_blocks - len(hashes)]
    for block_hash in hashes:
        pages = pool.allocate(largest.name, largest.num_layers)
        for page, lineage in zip(pages, largest.layer_lineages):
            pool.register(page, PageKey(lineage, block_hash))
            pool.release(page)
    kv = KVCacheManager(family, pool, config.pool.page_bytes, 4)
    estimator = ComplexityEstimator(synthetic_vocab(vocab_size), role_token_ids=range(len(ROLE_WORDS)))
    scheduler = Scheduler(family, config, pool, kv, estimator)
    request = Request(request_id=RequestId("bench"), prompt_token_ids=prompt, sampling=SamplingParams(), arrival_s=0.0)
    samples = []
    for call in range(WARMUP_CALLS + calls):
        t0 = time.perf_counter_ns()
        decision = scheduler.routing.route(request, estimator.score(prompt))
        if call >= WARMUP_CALLS:
            samples.append(time.perf_counter_ns() - t0)
    samples.sort()
    hash_ns = []
    for _ in range(WARMUP_CALLS + calls):
        t0 = time.perf_counter_ns()
        chain_block_hashes(prompt, block, seed)
        hash_ns.append(time.perf_counter_ns() - t0)
    hash_us = statistics.median(hash_ns[WARMUP_CALLS:]) / 1e3
    return {"hash_us_median": hash_us, "cached_blocks": pool.counts()["cached"] // largest.num_layers, "prompt_tokens": prompt_tokens,
            "matched_tokens_largest": decision.matched_prefix_tokens.get(largest.name, 0),
            "full_us_median": statistics.median(samples) / 1e3,
            "full_us_p99": percentile(samples, 99) / 1e3}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--prompt-tokens", type=int, default=DEFAULT_PROMPT_TOKENS)
    parser.add_argument("--calls", type=int, default=DEFAULT_CALLS)
    parser.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    args = parser.parse_args(argv)
    result = run(args.prompt_tokens, args.calls, args.vocab_size)
    if args.json:
        print(json.dumps({name: getattr(result, name) for name in result.__slots__}))
        return
    print(f"router bench: {result.prompt_tokens}-token prompt, {result.members} members, "
          f"median over {result.calls} calls")
    print(f"  complexity score  {result.score_us_median:8.1f} us")
    print(f"  router route      {result.route_us_median:8.1f} us")
    print(f"  score + route     {result.total_us_median:8.1f} us  (p99 {result.total_us_p99:.1f} us)")
    full = run_full_path(args.prompt_tokens, vocab_size=args.vocab_size)
    print(f"  full path (block hashes + cached-prefix estimate on every member, {full['cached_blocks']} cached "
          f"blocks, {full['matched_tokens_largest']} tokens matched) + score + route: "
          f"{full['full_us_median']:.1f} us  (p99 {full['full_us_p99']:.1f} us)")
    print(f"    of which the prompt's chained block hashes (reused by admission, needed for prefix caching "
          f"anyway): {full['hash_us_median']:.1f} us; routing proper: "
          f"{full['full_us_median'] - full['hash_us_median']:.1f} us")


if __name__ == "__main__":
    main()
