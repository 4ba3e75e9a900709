"""Published quality of the paper-scale members (eval/simulate/families.py PRESETS), and what a system's token
placement is worth under it.

A simulation runs no model, so it cannot score replies. What it can say is which member served each token
(member_token_share); weighting each member's published benchmark score by that share gives the quality of the
placement as the published table rates the members. Every figure here is the table's, labelled as such: not a
measurement of the simulated replies.

The table: MMLU (5-shot) of each member's pre-trained base checkpoint, as its developers published it (one
benchmark under one protocol for every size of a family). The Llama 3.1 presets are those base models; the Qwen3
presets name the post-trained models, whose base checkpoints (same architecture and size) the scores are of.
Scores compare within one family only: the two sources evaluate with their own pipelines.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

BENCHMARK = "MMLU (5-shot), pre-trained base checkpoint, as published"
QWEN3_REPORT = ("Qwen3 Technical Report (arXiv:2505.09388), Tables 4, 6 and 8: MMLU of Qwen3-32B-Base, "
                "Qwen3-8B-Base, Qwen3-1.7B-Base and Qwen3-0.6B-Base")
LLAMA31_CARD = ("Llama 3.1 model card (github.com/meta-llama/llama-models, models/llama3_1/MODEL_CARD.md), "
                "Base pretrained models: MMLU, 5-shot, macro_avg/acc_char")
# simulated member -> (score, source)
PUBLISHED_MMLU: dict[str, tuple[float, str]] = {
    "qwen3-0.6b": (52.81, QWEN3_REPORT),
    "qwen3-1.7b": (62.63, QWEN3_REPORT),
    "qwen3-8b": (76.89, QWEN3_REPORT),
    "qwen3-32b": (83.61, QWEN3_REPORT),
    "llama3.1-8b": (66.7, LLAMA31_CARD),
    "llama3.1-70b": (79.3, LLAMA31_CARD),
}


def covers(members: list[str]) -> bool:
    """Whether the table scores every member of a family."""
    return bool(members) and all(m in PUBLISHED_MMLU for m in members)


def table_quality(token_share: Mapping[str, float]) -> dict[str, Any] | None:
    """The share-weighted published score of a system's token placement (None when a member has no score or no
    token was served), with the table it comes from."""
    if not token_share or any(m not in PUBLISHED_MMLU for m in token_share):
        return None
    total = sum(token_share.values())
    if total <= 0:
        return None
    return {"score": sum(share * PUBLISHED_MMLU[m][0] for m, share in token_share.items()) / total,
            "benchmark": BENCHMARK, "member_scores": {m: PUBLISHED_MMLU[m][0] for m in token_share},
            "sources": sorted({PUBLISHED_MMLU[m][1] for m in token_share}),
            "label": "from the published table, weighted by member_token_share: not a measurement of the replies"}
