"""Microbenchmark of the routing hot path: ComplexityEstimator.score + Router.route per request."""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from orchestrator.complexity import ComplexityEstimator
from orchestrator.config import RouterConfig
from orchestrator.family import FamilySpec, MemberSpec
from orchestrator.router import MemberLoad, Router
from orchestrator.types import MemberName, Request, RequestId, SamplingParams

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
                     session_member=names[1], now_s=float(call))
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


if __name__ == "__main__":
    main()
