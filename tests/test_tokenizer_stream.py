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


# ids that decode to U+FFFD alone (a lone lead or continuation byte): what logit_bias can make the model emit
UNDECODABLE = [i for i in range(TOKENIZER.vocab_size) if TOKENIZER.decode([i]).endswith("\ufffd")]


def _byte_token_ids(byte_values: range) -> list[int]:
    """The byte-level BPE's one-byte tokens for these byte values (GPT-2's byte -> character alphabet)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    alphabet = {b: chr(b) for b in printable}
    alphabet.update({b: chr(256 + n) for n, b in enumerate(b for b in range(256) if b not in printable)})
    return [TOKENIZER._tokenizer.token_to_id(alphabet[b]) for b in byte_values]


# lone UTF-8 continuation bytes: no sequence of them ever decodes to a character
CONTINUATION_BYTES = _byte_token_ids(range(0x80, 0xC0))


class CountingTokenizer:
    """The tokenizer, counting decode calls and the ids they decoded."""

    def __init__(self, tokenizer: FamilyTokenizer):
        self.tokenizer, self.calls, self.decoded_ids = tokenizer, 0, 0

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        self.calls += 1
        self.decoded_ids += len(token_ids)
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)


@pytest.mark.parametrize("seed", range(8))
def test_random_ids_rich_in_undecodable_ones_stream_as_the_full_decode(seed):
    rng = random.Random(200 + seed)
    ids = [rng.choice(UNDECODABLE) if rng.random() < 0.6 else rng.randrange(3, TOKENIZER.vocab_size)
           for _ in range(400)]
    assert _stream(ids, (), rng) == (TOKENIZER.decode(ids), False)
    assert _stream(ids, (), random.Random(seed)) == (TOKENIZER.decode(ids), False)


def test_a_long_undecodable_reply_streams_in_linear_time_and_shows_its_text():
    """2,000 ids whose text ends in U+FFFD after every id: the decoder's work (decode calls, ids decoded) grows
    linearly with the reply, and the text reaches the client as it goes, not at the end."""
    rng = random.Random(7)
    ids = [rng.choice(CONTINUATION_BYTES) for _ in range(2000)]
    counting = CountingTokenizer(TOKENIZER)
    decoder = IncrementalDecoder(counting)
    streamed = "".join(decoder.push([token]) for token in ids)
    full = TOKENIZER.decode(ids)
    assert counting.calls <= 3 * len(ids)
    assert counting.decoded_ids <= 32 * len(ids)      # a window of a few ids per id, never the whole reply
    assert len(full) - len(streamed) <= 16            # held back: only the last few ids' text
    assert streamed + decoder.flush() == full


def test_a_stop_string_in_the_tail_held_at_the_end_still_stops():
    """The last id decodes to ' ' plus a lone lead byte: its text is held (it may start a character) until the
    stream ends; the stop string inside it must still cut the answer there."""
    lead = next(i for i in UNDECODABLE if TOKENIZER.decode([i]) == " \ufffd")
    ids = TOKENIZER.encode("Hello", add_special_tokens=False) + [lead]
    decoder = IncrementalDecoder(TOKENIZER, (" ",))
    text = "".join(decoder.push([token]) for token in ids)
    assert (text + decoder.flush(), decoder.stopped) == ("Hello", True)


def test_the_earliest_of_several_stop_strings_cuts():
    ids = TOKENIZER.encode("alpha beta gamma", add_special_tokens=False)
    decoder = IncrementalDecoder(TOKENIZER, ("gamma", "beta"))
    text = decoder.push(ids)
    assert (text + decoder.flush(), decoder.stopped) == ("alpha ", True)


def test_real_replies_of_the_tiny_family_stream_as_their_full_decode():
    """Sampled replies of the shipped tiny members (temperature 1.2; the last one biased towards byte pieces, as a
    client's logit_bias can), streamed one id at a time and in merged chunks, give exactly the full decode."""
    import asyncio
    import time

    from orchestrator.core.config import load_config
    from orchestrator.core.types import MemberName, Request, RequestId, SamplingParams
    from orchestrator.serve.serving import LocalServing

    prompts = ["Write a short note in French and German about café culture: déjà vu, Straße, naïve, 10 €.",
               "List some emoji and symbols with their names.", "Tell me a story about a river.",
               "Write in Japanese: 漢字かな 🙂"]
    biases = [(), (), (), tuple((t, 6.0) for t in UNDECODABLE)]

    async def replies() -> list[list[int]]:
        engine = LocalServing(load_config(None, {"family": str(family_dir()), "pool.num_pages": 512,
                                                 "pool.host_tier_mb": 0, "engine.device": "cpu",
                                                 "engine.num_threads": 1}))
        await engine.start()
        try:
            out = []
            for i, (prompt, bias) in enumerate(zip(prompts, biases)):
                sampling = SamplingParams(max_tokens=96, temperature=1.2, seed=i, ignore_eos=True, logit_bias=bias)
                request = Request(RequestId(f"r{i}"), engine.tokenizer.apply_chat_template(
                    [{"role": "user", "content": prompt}]), sampling, arrival_s=time.monotonic(),
                    pinned_member=MemberName(engine.member_names[i % len(engine.member_names)]))
                out.append([t async for o in engine.generate(request) for t in o.new_token_ids])
            return out
        finally:
            await engine.stop()

    answers = asyncio.run(replies())
    assert sum(t in UNDECODABLE for t in answers[-1]) >= 10
    for seed, ids in enumerate(answers):
        assert len(ids) == 96
        full = TOKENIZER.decode(ids)
        decoder = IncrementalDecoder(TOKENIZER)
        assert "".join(decoder.push([t]) for t in ids) + decoder.flush() == full
        assert _stream(ids, (), random.Random(seed)) == (full, False)
