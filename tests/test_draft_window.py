"""The draft's attention window (speculation.draft_window): draft rows attend to the sink positions and their
last `window` positions only, in the engine's attention (decode and prefill groups, against attention over
exactly those keys), in the local engine's drafting (greedy tokens still plain decoding's), and in the core's
forward shapes (a draft forward is priced at the keys it reads)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engines.local.attention import attend, decode_group, prefill_group
from eval.simulate.measure_speculation import Decode, SpeculativeRun, acceptance_stats, workload_prompts
from orchestrator.core.config import MFSConfig, SpeculationConfig
from orchestrator.core.family import SHIPPED_FAMILIES_DIR, load_family
from orchestrator.core.draft_length import plan_forwards
from orchestrator.core.types import (DraftSpec, MemberBatch, PageId, RequestId, SamplingParams, SeqChunk, StepPlan,
                                     attended_keys)

HEADS, KV_HEADS, DIM, BLOCK, NUM_PAGES = 4, 2, 16, 4, 64


def _kv(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    view = torch.randn(NUM_PAGES, 2, BLOCK, KV_HEADS, DIM, generator=gen)
    return view[:, 0].flatten(1), view[:, 1].flatten(1)


def _keys(kv_rows: tuple[torch.Tensor, torch.Tensor], pages: list[int], positions: list[int]):
    """[kv_heads, len(positions), dim] K and V of those positions of a sequence on `pages`."""
    out = []
    for rows in kv_rows:
        seq = rows[torch.tensor(pages)].view(-1, KV_HEADS, DIM)
        out.append(seq[torch.tensor(positions)].transpose(0, 1))
    return out


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """One query row [heads, dim] over exactly the keys given (GQA by repeating K and V)."""
    groups = HEADS // KV_HEADS
    k, v = k.repeat_interleave(groups, 0), v.repeat_interleave(groups, 0)
    return F.scaled_dot_product_attention(q[:, None, :], k, v)[:, 0, :]


def _window_positions(position: int, window: int, sinks: int) -> list[int]:
    return [p for p in range(position + 1) if p < sinks or p > position - window]


def test_windowed_decode_rows_read_only_the_sinks_and_their_window():
    kv_rows = _kv(0)
    lengths = [30, 9, 22]                          # keys per sequence (position + 1)
    windows = [(8, 2), (0, 0), (5, 0)]             # a windowed row, an ordinary one, a window without sinks
    tables = torch.arange(3 * 8).view(3, 1, 8)     # one layer, 8 pages each
    group = decode_group([0, 1, 2], [0, 1, 2], tables, lengths, 8, 3, torch.float32, windows)
    assert group.key_lengths is None               # no in-place kernel: it reads every key up to the length
    q = torch.randn(3, HEADS, DIM, generator=torch.Generator().manual_seed(1))
    got = attend(q, kv_rows, group, 0, KV_HEADS, DIM)
    for i, (n, (window, sinks)) in enumerate(zip(lengths, windows)):
        positions = _window_positions(n - 1, window, sinks) if window else list(range(n))
        k, v = _keys(kv_rows, tables[i, 0].tolist(), positions)
        torch.testing.assert_close(got[i], _reference(q[i], k, v), rtol=1e-5, atol=1e-5)
    plain = attend(q, kv_rows, decode_group([0, 1, 2], [0, 1, 2], tables, lengths, 8, 3, torch.float32), 0,
                   KV_HEADS, DIM)
    assert not torch.allclose(plain[0], got[0])    # the window hid keys the plain row reads
    torch.testing.assert_close(plain[1], got[1])


def test_a_window_wider_than_the_context_changes_nothing():
    tables = torch.arange(8).view(1, 1, 8)
    group = decode_group([0], [0], tables, [12], 3, 1, torch.float32, [(16, 4)])
    assert group.mask is None and group.key_lengths is not None     # the in-place kernel still applies


def test_windowed_prefill_rows_read_only_the_sinks_and_their_window():
    kv_rows = _kv(2)
    start, n, window, sinks = 10, 6, 5, 2
    table = torch.arange(8)[None, :]                # [layers, blocks]
    group = prefill_group(0, n, start, table[:, :-(-(start + n) // BLOCK)], HEADS // KV_HEADS,
                          torch.float32, window, sinks)
    q = torch.randn(n, HEADS, DIM, generator=torch.Generator().manual_seed(3))
    got = attend(q, kv_rows, group, 0, KV_HEADS, DIM)
    for row in range(n):
        k, v = _keys(kv_rows, table[0].tolist(), _window_positions(start + row, window, sinks))
        torch.testing.assert_close(got[row], _reference(q[row], k, v), rtol=1e-5, atol=1e-5)


def test_attended_keys_counts_what_the_masks_leave():
    for position in range(40):
        for window, sinks in ((8, 2), (5, 0), (1, 4), (0, 0)):
            expected = len(_window_positions(position, window, sinks)) if window else position + 1
            assert attended_keys(position, window, sinks) + 1 == expected, (position, window, sinks)


# ----------------------------------------------------------------------------- the local engine's drafting
BLOCK_TOKENS = 16


@pytest.fixture(scope="module")
def family():
    return load_family(SHIPPED_FAMILIES_DIR / "tiny")


def _executor(family, **options):
    from engines.local.executor import LocalExecutor

    member = family.members[-1]
    return LocalExecutor(family, num_pages=6000, page_bytes=BLOCK_TOKENS * member.kv_bytes_per_token_per_layer(4),
                         num_threads=1, **options)


@pytest.mark.parametrize("options", [{}, dict(native_attention=False, native_layer_ops=False)],
                         ids=["native", "torch-ops"])
def test_windowed_drafts_keep_plain_decodings_tokens(family, options):
    """Greedy requests drafting with a window far shorter than their context get plain decoding's tokens (the
    verify attends to everything); the drafts themselves differ from full-context drafts."""
    prompts = workload_prompts(family.members[0].tokenizer_hash, count=4, max_tokens=60)
    greedy = SamplingParams(max_tokens=24)

    def decodes(window: int) -> list[Decode]:
        return [Decode(f"r{i}", prompt, "tiny-l", greedy, "tiny-s", 3, window=window, sink_tokens=2 if window else 0)
                for i, prompt in enumerate(prompts)]

    plain = [Decode(f"r{i}", prompt, "tiny-l", greedy) for i, prompt in enumerate(prompts)]
    SpeculativeRun(_executor(family), plain).run()
    windowed, full = decodes(6), decodes(0)
    SpeculativeRun(_executor(family, **options), windowed).run()
    SpeculativeRun(_executor(family, **options), full).run()
    for w, f, p in zip(windowed, full, plain):
        assert w.generated == p.generated == f.generated, w.request_id
        assert w.dropped == 0
    assert [d.verified for d in windowed] != [d.verified for d in full]     # the window changed what was drafted
    assert acceptance_stats(windowed)["verify_steps"] > 0


# ----------------------------------------------------------------------------- the core
def _draft_chunk(window: int) -> SeqChunk:
    tables = [[PageId(i) for i in range(40)]]
    spec = DraftSpec(member="s", num_tokens=3, token_ids=[7], start_pos=300, block_tables=tables,
                     window=window, sink_tokens=4)
    return SeqChunk(request_id=RequestId("a"), token_ids=[7], start_pos=300, block_tables=tables, sample=True,
                    sampling=SamplingParams(max_tokens=50), draft=spec)


def test_draft_forwards_are_shaped_at_the_keys_they_read():
    windowed = plan_forwards(StepPlan(batches=[MemberBatch("l", [_draft_chunk(64)])]))
    full = plan_forwards(StepPlan(batches=[MemberBatch("l", [_draft_chunk(0)])]))
    assert [f.decode_contexts for f in full if f.is_draft] == [(300,), (301,), (302,)]
    assert [f.decode_contexts for f in windowed if f.is_draft] == [(67,), (67,), (67,)]     # 4 sinks + 64 - 1
    # the verify reads everything either way
    assert [f.verifies for f in windowed if not f.is_draft] == [f.verifies for f in full if not f.is_draft] \
        == [((4, 300),)]


def test_a_negative_window_is_refused_by_name():
    with pytest.raises(ValueError, match="speculation.draft_window"):
        MFSConfig(speculation=SpeculationConfig(draft_window=-1)).validate()


def test_the_acceptance_tool_measures_each_window_and_the_table_keeps_the_unwindowed_figure(tmp_path, capsys):
    from eval.simulate.acceptance import load_table
    from eval.simulate.measure_speculation import main

    out = tmp_path / "table.json"
    assert main(["--prompts", "2", "--new-tokens", "12", "--draft-window", "0,6", "--out", str(out)]) == 0
    import json

    rows = json.loads(out.read_text())["acceptance"]
    assert sorted({row.get("draft_window", 0) for row in rows}) == [0, 6]
    plain = {(r["draft"], r["target"], r["temperature"]): r["per_token_acceptance"] for r in rows
             if not r.get("draft_window")}
    table = load_table(out, ["tiny-s->tiny-l"])
    assert table.of("tiny-s->tiny-l").for_temperature(0.0) == plain[("tiny-s", "tiny-l", 0.0)]
    assert "window" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["--draft-window", "-4", "--out", str(out)])
