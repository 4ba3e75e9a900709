"""IncrementalDecoder decodes a window, not the whole answer: its deltas must add up to exactly what a full decode
gives, whatever the chunking (one token per step, or several merged), with multi-byte characters split across
tokens, and stop strings cut where a full decode would cut."""
from __future__ import annotations

import random

import pytest

from orchestrator.serve.tokenizer import FamilyTokenizer, IncrementalDecoder
from tests.fakes_serving import family_dir

TOKENIZER = FamilyTokenizer(family_dir() / "tiny-l")
TEXTS = ["Plain ASCII: the quick brown fox jumps over the lazy dog, twice.",
         "Accents and symbols: café, naïve, über, 10 € and 5 £; emoji 🙂🚀 and CJK 漢字かな.",
         "Line\nbreaks\n\n and   spaces\tand tabs; quotes \"like\" 'this'."]


def _chunks(ids: list[int], rng: random.Random) -> list[list[int]]:
    out, at = [], 0
    while at < len(ids):
        size = rng.choice([1, 1, 1, 2, 3, 5])
        out.append(ids[at:at + size])
        at += size
    return out


def _stream(ids: list[int], stops: tuple[str, ...], rng: random.Random) -> tuple[str, bool]:
    decoder = IncrementalDecoder(TOKENIZER, stops)
    text = "".join(decoder.push(chunk) for chunk in _chunks(ids, rng))
    return text + decoder.flush(), decoder.stopped


@pytest.mark.parametrize("seed", range(6))
def test_deltas_add_up_to_the_full_decode(seed):
    rng = random.Random(seed)
    for text in TEXTS:
        ids = TOKENIZER.encode(text, add_special_tokens=False)
        assert _stream(ids, (), rng) == (TOKENIZER.decode(ids), False)
    # random ids: byte tokens that split (and break) UTF-8 sequences anywhere
    ids = [rng.randrange(3, TOKENIZER.vocab_size) for _ in range(300)]
    assert _stream(ids, (), rng) == (TOKENIZER.decode(ids), False)


@pytest.mark.parametrize("seed", range(6))
def test_a_stop_string_cuts_where_the_full_text_has_it(seed):
    rng = random.Random(100 + seed)
    for text in TEXTS:
        ids = TOKENIZER.encode(text, add_special_tokens=False)
        full = TOKENIZER.decode(ids)
        at = rng.randrange(5, len(full) - 6)
        stop = full[at:at + rng.randrange(1, 5)]
        assert _stream(ids, (stop,), rng) == (full[:full.find(stop)], True)
