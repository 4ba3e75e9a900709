"""Training text that teaches replies to END: ShareGPT chats with assistant replies cut short and closed by <|eot|>."""
from __future__ import annotations

import math
import random
import re

import torch

from build_scripts.train_tiny_family import SPECIAL_TOKENS

REPLY_RULE = (  # recorded in training.json and the family README
    "For every assistant reply draw a token budget B = clamp(round(lognormal(median 40, sigma 0.7)), 6, 112)\n"
    "from an RNG seeded by (seed, conversation id, turn). A reply longer than B tokens is cut at its last\n"
    "sentence boundary (after . ! ? followed by white space, or before a newline) inside its first B tokens,\n"
    "else at its first sentence boundary inside 112 tokens, else at its last word boundary inside B tokens;\n"
    "shorter replies stay whole. The reply then ends with <|eot|> as the chat template renders it. Loss\n"
    "weights: assistant text 1, the <|eot|> closing an assistant reply 5, everything else (user and system\n"
    "text, role tags, <|bos|>) 0.5."
)
BUDGET_MEDIAN, BUDGET_SIGMA, BUDGET_MIN, BUDGET_MAX = 40, 0.7, 6, 112
EOT_WEIGHT, ASSISTANT_WEIGHT, CONTEXT_WEIGHT = 5.0, 1.0, 0.5
EOT_ID = SPECIAL_TOKENS.index("<|eot|>")
BOS_ID = SPECIAL_TOKENS.index("<|bos|>")
# a sentence ends after . ! ? (and any closing quote/bracket) followed by white space; a line ends before \n
_SENTENCE_END = re.compile(r"[.!?][\"')\]]*(?=\s)|\n")


def reply_budget(seed: int, conversation_id: str, turn: int) -> int:
    """Tokens this reply may keep; mostly under 100 so a 128-token cap rarely binds."""
    rng = random.Random(f"{seed}|{conversation_id}|{turn}")  # str seeds hash stably across runs
    drawn = round(rng.lognormvariate(math.log(BUDGET_MEDIAN), BUDGET_SIGMA))
    return max(BUDGET_MIN, min(BUDGET_MAX, drawn))


def cut_reply(piece: str, offsets: list[tuple[int, int]], budget: int) -> str:
    """piece ('\\n' + reply text) cut to at most `budget` tokens at a sentence, else word, boundary."""
    if len(offsets) <= budget:
        return piece[:1] + piece[1:].rstrip()  # keep the leading newline the template puts after the role
    limit = offsets[budget - 1][1]          # last character the first `budget` tokens cover
    hard_limit = offsets[min(len(offsets), BUDGET_MAX) - 1][1]
    best = 0
    for match in _SENTENCE_END.finditer(piece, 1, hard_limit + 1):
        end = match.start() if match.group() == "\n" else match.end()
        if not piece[1:end].strip():
            continue
        if end > limit:  # a first sentence longer than the budget: still end it whole (within BUDGET_MAX)
            best = best or end
            break
        best = end
    if not best:  # no sentence ends within BUDGET_MAX tokens: a word boundary, so the model still sees an end
        best = piece.rfind(" ", 1, limit + 1)
        best = best if best > 1 else limit
    return piece[:1] + piece[1:best].rstrip()


def conversation_pieces(tokenizer, conversation, seed: int) -> list[tuple[list[int], float]]:
    """(token ids, loss weight) pieces of one rendered conversation, assistant replies cut by the rule.

    Pieces split where the tokenizer splits anyway (around special tokens), so their concatenation equals
    encoding render_chat(cut messages) whole (a test checks it)."""
    newline = tokenizer.encode("\n").ids
    pieces: list[tuple[list[int], float]] = [([BOS_ID], CONTEXT_WEIGHT)]
    for turn, message in enumerate(conversation.messages):
        role_id = SPECIAL_TOKENS.index(f"<|{message['role']}|>")
        text = "\n" + message["content"]
        if message["role"] == "assistant":
            enc = tokenizer.encode(text)
            text = cut_reply(text, enc.offsets, reply_budget(seed, conversation.conversation_id, turn))
        ids = tokenizer.encode(text).ids
        weight = ASSISTANT_WEIGHT if message["role"] == "assistant" else CONTEXT_WEIGHT
        eot_weight = EOT_WEIGHT if message["role"] == "assistant" else CONTEXT_WEIGHT
        pieces += [([role_id], CONTEXT_WEIGHT), (ids, weight), ([EOT_ID], eot_weight), (newline, CONTEXT_WEIGHT)]
    return pieces


def cut_messages(tokenizer, conversation, seed: int) -> list[dict[str, str]]:
    """The conversation's messages as the rule cuts them (what the pieces render)."""
    out = []
    for turn, message in enumerate(conversation.messages):
        text = "\n" + message["content"]
        if message["role"] == "assistant":
            text = cut_reply(text, tokenizer.encode(text).offsets,
                             reply_budget(seed, conversation.conversation_id, turn))
        out.append({"role": message["role"], "content": text[1:]})
    return out


def weighted_windows(tokenizer, conversations, window: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Conversations packed end to end into [n, window] token ids and matching loss weights."""
    ids: list[int] = []
    weights: list[float] = []
    for conversation in conversations:
        for piece, weight in conversation_pieces(tokenizer, conversation, seed):
            ids.extend(piece)
            weights.extend([weight] * len(piece))
    usable = (len(ids) // window) * window
    return (torch.tensor(ids[:usable], dtype=torch.long).view(-1, window),
            torch.tensor(weights[:usable], dtype=torch.float32).view(-1, window))
