"""Prompt complexity estimator: token ids -> a difficulty score in [0, 1], no tokenizer calls."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

# Cue lexicons, matched against each vocab entry's lowercased, stripped text.
CODE_WORDS = frozenset({
    "def", "class", "import", "from", "function", "return", "lambda", "elif", "const", "let", "var",
    "void", "struct", "enum", "fn", "pub", "impl", "async", "await", "yield", "self", "this", "null",
    "none", "nullptr", "printf", "print", "println", "#include", "#define", "public", "private",
    "static", "int", "char", "bool", "string", "try", "except", "catch", "throw", "raise", "sql",
    "select", "python", "javascript", "typescript", "java", "rust", "golang", "bash", "regex", "api",
})
CODE_SYMBOLS = ("```", "{", "}", ";", "==", "!=", "=>", "->", "::", "()", "[]", "</", "/>", "&&", "||", "+=", "__")
REASONING_STEMS = (
    "why", "explain", "explan", "prove", "proof", "step", "because", "analy", "compar", "calcul",
    "reason", "deriv", "justif", "evaluat", "solve", "solving", "therefore", "hence", "infer",
    "deduc", "algorithm", "optimi", "tradeoff", "trade-off", "implication", "consequen", "hypothes",
)
MATH_WORDS = frozenset({
    "sum", "integral", "derivative", "equation", "matrix", "theorem", "lemma", "sqrt", "log", "sin",
    "cos", "tan", "probability", "variance", "mod", "modulo", "prime", "polynomial", "vector", "limit",
    "\\frac", "\\sum", "\\int", "\\sqrt", "\\cdot", "\\times", "\\leq", "\\geq", "\\pi",
})
MATH_CHARS = frozenset("0123456789+-*/^=<>%().,")
MATH_SIGNAL_CHARS = frozenset("0123456789+-*/^=<>%")   # a math token needs one of these, not only '(' or '.'

# Chat-template role markers of the shipped families' tokenizers: their count measures the number of turns.
ROLE_MARKERS = ("<|user|>", "<|assistant|>", "<|system|>", "<|im_start|>", "<|start_header_id|>")

# Bit flags of the per-token-id lookup table.
_CODE, _REASONING, _MATH, _ROLE = 1, 2, 4, 8


@dataclass(frozen=True, slots=True)
class ComplexityParams:
    """Knobs of the estimator (see ComplexityEstimator's docstring for the formula)."""

    length_saturation_tokens: int = 2048    # prompts this long get the full length score
    diversity_window_tokens: int = 256      # lexical diversity is measured over the last N tokens
    short_prompt_floor_tokens: int = 32     # densities divide by at least this: a 3-token "why?" is not dense
    code_density_saturation: float = 0.06   # fraction of code-cue tokens that counts as fully code-like
    reasoning_density_saturation: float = 0.02
    math_density_saturation: float = 0.10
    turns_saturation: int = 12              # role-token occurrences (about 2 per chat turn) for the full score
    weight_length: float = 0.35
    weight_diversity: float = 0.10
    weight_cues: float = 0.45
    weight_turns: float = 0.10


class ComplexityEstimator:
    """Scores a tokenized prompt's difficulty in [0, 1] from cheap lexical signals.

    With n = len(token_ids), floor = max(n, short_prompt_floor_tokens):
      length    = min(1, ln(1 + n) / ln(1 + length_saturation_tokens))
      diversity = unique(tail) / max(len(tail), short_prompt_floor_tokens), tail = last diversity_window_tokens
      code      = min(1, count(code cue tokens) / floor / code_density_saturation)
      reasoning = min(1, count(reasoning cue tokens) / floor / reasoning_density_saturation)
      math      = min(1, count(digit / operator / math-word tokens) / floor / math_density_saturation)
      cues      = 1 - (1 - code)(1 - reasoning)(1 - math)      noisy-or: one strong cue suffices, several reinforce
      turns     = min(1, count(role tokens) / turns_saturation)
      score     = (w_len*length + w_div*diversity + w_cues*cues + w_turns*turns) / (sum of the weights)
    Every signal is in [0, 1], so the score is too. Cue membership is decided once per vocab entry in
    __init__ (one byte of flags per token id), so score() is one C-level pass over the ids plus a set
    over the tail: O(len) with small constants, deterministic, no tokenizer calls.
    """

    __slots__ = ("params", "_flags", "_flag_values", "_weight_total")

    def __init__(self, vocab: Sequence[str], role_token_ids: Sequence[int] = (),
                 params: ComplexityParams | None = None) -> None:
        self.params = params or ComplexityParams()
        flags = [_token_flags(text) for text in vocab]
        for token_id in role_token_ids:
            if 0 <= token_id < len(flags):
                flags[token_id] |= _ROLE
        self._flags = flags
        # Only the flag combinations some token actually carries need counting.
        self._flag_values = tuple(sorted({f for f in flags if f}))
        p = self.params
        self._weight_total = p.weight_length + p.weight_diversity + p.weight_cues + p.weight_turns

    def score(self, token_ids: Sequence[int]) -> float:
        return self._signals(token_ids)[-1]

    def components(self, token_ids: Sequence[int]) -> dict[str, float]:
        """Every signal of the formula plus the final 'score', for explanations and logs."""
        names = ("length", "diversity", "code", "reasoning", "math", "cues", "turns", "score")
        return dict(zip(names, self._signals(token_ids)))

    # ------------------------------------------------------------------------- internals
    def _signals(self, token_ids: Sequence[int]) -> tuple[float, ...]:
        p = self.params
        n = len(token_ids)
        if n == 0:
            return (0.0,) * 8
        code_n, reasoning_n, math_n, role_n = self._cue_counts(token_ids)
        floor = max(n, p.short_prompt_floor_tokens)
        length = min(1.0, math.log1p(n) / math.log1p(p.length_saturation_tokens))
        tail = token_ids[-p.diversity_window_tokens:]
        diversity = len(set(tail)) / max(len(tail), p.short_prompt_floor_tokens)
        code = min(1.0, code_n / floor / p.code_density_saturation)
        reasoning = min(1.0, reasoning_n / floor / p.reasoning_density_saturation)
        math_score = min(1.0, math_n / floor / p.math_density_saturation)
        cues = 1.0 - (1.0 - code) * (1.0 - reasoning) * (1.0 - math_score)
        turns = min(1.0, role_n / p.turns_saturation)
        total = (p.weight_length * length + p.weight_diversity * diversity + p.weight_cues * cues
                 + p.weight_turns * turns) / self._weight_total
        return (length, diversity, code, reasoning, math_score, cues, turns, min(1.0, max(0.0, total)))

    def _cue_counts(self, token_ids: Sequence[int]) -> tuple[int, int, int, int]:
        flags = self._flags
        try:
            # One C-level pass: map ids to their flag byte, then count each flag combination.
            packed = bytes(map(flags.__getitem__, token_ids))
        except IndexError:
            # Ids outside the vocab (or negative) carry no cue.
            size = len(flags)
            packed = bytes(flags[t] if 0 <= t < size else 0 for t in token_ids)
        counts = [0, 0, 0, 0]
        for value in self._flag_values:
            hits = packed.count(value)
            if hits:
                if value & _CODE:
                    counts[0] += hits
                if value & _REASONING:
                    counts[1] += hits
                if value & _MATH:
                    counts[2] += hits
                if value & _ROLE:
                    counts[3] += hits
        return counts[0], counts[1], counts[2], counts[3]


def estimator_for_vocab(vocab: Sequence[str], role_markers: Sequence[str] = ROLE_MARKERS,
                        params: ComplexityParams | None = None) -> ComplexityEstimator:
    """The estimator for a tokenizer whose id i decodes to vocab[i]; ids whose text is a role marker
    count as turns. The edge decodes the vocabulary (it owns the tokenizer); the rule lives here."""
    markers = frozenset(role_markers)
    roles = [token_id for token_id, text in enumerate(vocab) if text in markers]
    return ComplexityEstimator(vocab, role_token_ids=roles, params=params)


def _token_flags(text: str) -> int:
    """Cue flags of one vocab entry (lowercased, stripped); 0 for an ordinary token."""
    word = text.strip().lower()
    if not word:
        return 0
    flags = 0
    if word in CODE_WORDS or any(symbol in word for symbol in CODE_SYMBOLS):
        flags |= _CODE
    if word.startswith(REASONING_STEMS):
        flags |= _REASONING
    if word in MATH_WORDS or (all(ch in MATH_CHARS for ch in word) and any(ch in MATH_SIGNAL_CHARS for ch in word)):
        flags |= _MATH
    return flags
