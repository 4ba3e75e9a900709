"""Calibrates the escalation threshold: the distribution of each member's rolling top-1 probability on
real ShareGPT replies (teacher-forced), and what fraction of replies a threshold would escalate.

    python -m eval.probes.calibrate_escalation [--family tiny] [--conversations 40] [--window 8]
"""
from __future__ import annotations

import argparse
import statistics

import torch

from orchestrator.sharegpt import iter_conversations
from orchestrator.core.family import load_family
from orchestrator.serve.tokenizer import FamilyTokenizer


def rolling_means(values: list[float], window: int) -> list[float]:
    return [statistics.fmean(values[i - window:i]) for i in range(window, len(values) + 1)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", default="tiny")
    parser.add_argument("--conversations", type=int, default=40)
    parser.add_argument("--window", type=int, default=8)
    parser.add_argument("--reply-tokens", type=int, default=64)
    parser.add_argument("--skip", type=int, default=15000, help="start past the conversations used for training")
    args = parser.parse_args(argv)

    from engines.local.executor import LocalExecutor
    from engines.local.scoring import sequence_logits

    family = load_family(args.family)
    tokenizer = FamilyTokenizer(family.members[0].checkpoint_dir)
    executor = LocalExecutor(family, num_pages=64, page_bytes=16384)
    # conversations past the training slice, so the members are scored on text they did not train on
    samples = list(iter_conversations(limit=args.skip + args.conversations))[args.skip:]
    windows: dict[str, list[float]] = {m.name: [] for m in family.members}
    reply_means: dict[str, list[float]] = {m.name: [] for m in family.members}
    with torch.inference_mode():
        for conversation in samples:
            prompt = tokenizer.apply_chat_template(list(conversation.messages[:1]))
            reply = tokenizer.encode(conversation.messages[1]["content"], add_special_tokens=False)[:args.reply_tokens]
            ids = (prompt + reply)[: min(m.context_tokens for m in family.members)]
            for member in family.members:
                probs = sequence_logits(executor, member.name, ids)[len(prompt) - 1:].softmax(-1)
                top1 = probs.max(-1).values.tolist()
                windows[member.name].extend(rolling_means(top1, args.window))
                reply_means[member.name].append(min(rolling_means(top1, args.window), default=1.0))
    print(f"rolling top-1 probability (window {args.window}) over {len(samples)} ShareGPT replies")
    print(f"{'member':<8}{'p10':>8}{'p25':>8}{'p50':>8}{'p75':>8}   replies escalated at threshold 0.10/0.15/0.20/0.30")
    for name, values in windows.items():
        q = statistics.quantiles(values, n=20)
        lows = reply_means[name]
        rates = "/".join(f"{sum(v < t for v in lows) / len(lows):.0%}" for t in (0.10, 0.15, 0.20, 0.30))
        print(f"{name:<8}{q[1]:8.3f}{q[4]:8.3f}{q[9]:8.3f}{q[14]:8.3f}   {rates}")


if __name__ == "__main__":
    main()
