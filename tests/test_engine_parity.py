"""Local engine vs transformers: greedy tokens and fp32 logits (single, batched, prefix hit, chunked, nested handover),
and greedy tokens of every member of the shipped families (nested `tiny`, separate-weight `tiny-sep`)."""
from __future__ import annotations

import pytest
import torch

from conftest_engine import (EngineRequest, PageCounter, build_model, hf_generate, hf_logits, llama_config,
                             nested_pair, next_chunk, qwen2_config, run_to_completion, write_family)
from engines.local.executor import LocalExecutor
from engines.local.scoring import score_tokens
from orchestrator.core.family import load_family
from orchestrator.core.types import MemberBatch, RequestId, SamplingParams, SeqChunk, StepPlan

PAGE_BYTES = 1024          # 2 kv heads * 16 dims * 2 (K, V) * 4 bytes = 256 B per token per layer -> 4 tokens
NUM_PAGES = 1024
NEW_TOKENS = 6


def _prompt(length: int, offset: int = 0) -> list[int]:
    return [(7 * i + 3 + offset) % 250 + 3 for i in range(length)]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def setup(request, tmp_path_factory):
    """(executor, hf model, member name) for a 3-layer model; qwen2's checkpoint is sharded."""
    root = tmp_path_factory.mktemp(request.param)
    if request.param == "llama":
        model = build_model(llama_config(num_layers=3))
        write_family(root, [("m", model)])
    else:
        model = build_model(qwen2_config(num_layers=3))
        root.mkdir(exist_ok=True)
        from conftest_engine import save_checkpoint
        save_checkpoint(model, root / "m", max_shard_size="60KB")
        assert (root / "m" / "model.safetensors.index.json").is_file()
        (root / "family.yaml").write_text("name: fam\nmembers:\n  - name: m\n")
    executor = LocalExecutor(load_family(root), num_pages=NUM_PAGES, page_bytes=PAGE_BYTES)
    return executor, model, "m"


def _request(name: str, prompt: list[int], num_layers: int = 3) -> EngineRequest:
    return EngineRequest(request_id=name, prompt=prompt, max_new_tokens=NEW_TOKENS,
                         tables=[[] for _ in range(num_layers)])


def test_full_logits_match_transformers(setup):
    executor, model, member = setup
    prompt = _prompt(23)
    pages = PageCounter(NUM_PAGES)
    block = executor.tokens_per_block(member)
    tables = [pages.take(-(-len(prompt) // block)) for _ in range(3)]
    chunk = SeqChunk(request_id=RequestId("a"), token_ids=prompt, start_pos=0, block_tables=tables, sample=True,
                     sampling=SamplingParams())
    ours = executor.model(member).forward(executor.arena, [chunk], all_logits=True)
    torch.testing.assert_close(ours, hf_logits(model, prompt), atol=1e-4, rtol=0)


def test_single_request_greedy_matches_generate(setup):
    executor, model, member = setup
    request = _request("single", _prompt(11))
    run_to_completion(executor, member, [request], PageCounter(NUM_PAGES))
    assert request.generated == hf_generate(model, request.prompt, NEW_TOKENS)


def test_batch_of_different_lengths_matches_each_generate(setup):
    executor, model, member = setup
    requests = [_request(f"r{i}", _prompt(n, offset=i)) for i, n in enumerate([1, 5, 9, 17])]
    run_to_completion(executor, member, requests, PageCounter(NUM_PAGES))
    for request in requests:
        assert request.generated == hf_generate(model, request.prompt, NEW_TOKENS), request.request_id


def test_chunked_prefill_matches_generate(setup):
    executor, model, member = setup
    requests = [_request("long", _prompt(19)), _request("short", _prompt(3, offset=5))]
    run_to_completion(executor, member, requests, PageCounter(NUM_PAGES), chunk_tokens=5)
    for request in requests:
        assert request.generated == hf_generate(model, request.prompt, NEW_TOKENS), request.request_id


def test_prefix_cache_hit_reuses_pages(setup):
    executor, model, member = setup
    pages = PageCounter(NUM_PAGES)
    block = executor.tokens_per_block(member)
    first = _request("first", _prompt(18))
    run_to_completion(executor, member, [first], pages)
    shared_blocks = 16 // block                        # full prompt blocks only
    second_prompt = first.prompt[:16] + _prompt(5, offset=40)
    second = EngineRequest(request_id="second", prompt=second_prompt, max_new_tokens=NEW_TOKENS,
                           tables=[list(t[:shared_blocks]) for t in first.tables], cached_tokens=16)
    run_to_completion(executor, member, [second], pages)
    assert [t[:shared_blocks] for t in second.tables] == [t[:shared_blocks] for t in first.tables]
    assert second.generated == hf_generate(model, second_prompt, NEW_TOKENS)


def test_score_tokens_matches_transformers(setup):
    executor, model, member = setup
    tokens = _prompt(14)
    expected = torch.log_softmax(hf_logits(model, tokens), -1)[4:-1].gather(1, torch.tensor(tokens[5:])[:, None])
    scores = score_tokens(executor, member, tokens, start=5)
    torch.testing.assert_close(torch.tensor(scores), expected[:, 0], atol=1e-4, rtol=0)
    alone = score_tokens(executor.model(member), member, tokens, start=5)    # own page size, own arena
    torch.testing.assert_close(torch.tensor(alone), expected[:, 0], atol=1e-4, rtol=0)


@pytest.fixture(scope="module", params=[llama_config, qwen2_config], ids=["llama", "qwen2"])
def nested(request, tmp_path_factory):
    small, large = nested_pair(request.param, small_layers=2, large_layers=3)
    root = write_family(tmp_path_factory.mktemp("nested"), [("a", small), ("b", large)])
    family = load_family(root)
    assert family.shared_depth("a", "b") == 2
    # page of 1500 bytes: 4 tokens per block with an unused tail; a residual block (4 * 64 * 4 B) fits
    executor = LocalExecutor(family, num_pages=NUM_PAGES, page_bytes=1500)
    return executor, large


def test_nested_handover_matches_full_forward(nested):
    executor, large = nested
    assert executor.model("a").weights.layers[1] is executor.model("b").weights.layers[1]   # shared tensors
    pages = PageCounter(NUM_PAGES)
    block = executor.tokens_per_block("b")
    prompt, other = _prompt(13), _prompt(6, offset=9)
    num_blocks = -(-len(prompt) // block)
    small_tables = [pages.take(num_blocks) for _ in range(2)]
    residual_pages = pages.take(num_blocks)
    small_chunk = SeqChunk(request_id=RequestId("x"), token_ids=prompt, start_pos=0, block_tables=small_tables,
                           sample=True, sampling=SamplingParams(), residual_table_out=residual_pages)
    executor.model("a").forward(executor.arena, [small_chunk])
    handover = SeqChunk(request_id=RequestId("x"), token_ids=prompt, start_pos=0,
                        block_tables=small_tables + [pages.take(num_blocks)], sample=True,
                        sampling=SamplingParams(), start_layer=2, residual_table=residual_pages)
    fresh = SeqChunk(request_id=RequestId("y"), token_ids=other, start_pos=0,
                     block_tables=[pages.take(2) for _ in range(3)], sample=True, sampling=SamplingParams())
    logits = executor.model("b").forward(executor.arena, [handover, fresh], all_logits=True)
    torch.testing.assert_close(logits[:len(prompt)], hf_logits(large, prompt), atol=1e-4, rtol=0)
    torch.testing.assert_close(logits[len(prompt):], hf_logits(large, other), atol=1e-4, rtol=0)
    # decode on after the handover: the large member reads the small member's pages for layers 0-1
    request = EngineRequest(request_id="x", prompt=prompt, max_new_tokens=NEW_TOKENS, tables=handover.block_tables,
                            cached_tokens=len(prompt), generated=[int(logits[len(prompt) - 1].argmax())])
    request.fed = len(prompt)
    run_to_completion(executor, "b", [request], pages)
    assert request.generated == hf_generate(large, prompt, NEW_TOKENS)


def test_plan_runs_each_member_and_returns_tokens_in_chunk_order(nested):
    executor, large = nested
    pages = PageCounter(NUM_PAGES)
    prompts = {"p": _prompt(5), "q": _prompt(7, offset=3), "r": _prompt(4, offset=8)}

    def chunk(name: str, num_layers: int, sample: bool) -> SeqChunk:
        return SeqChunk(request_id=RequestId(name), token_ids=prompts[name], start_pos=0,
                        block_tables=[pages.take(2) for _ in range(num_layers)], sample=sample,
                        sampling=SamplingParams())

    plan = StepPlan(batches=[MemberBatch("a", [chunk("p", 2, True)]),
                             MemberBatch("b", [chunk("q", 3, False), chunk("r", 3, True)])],
                    released_requests=[RequestId("gone")])
    sampled = executor.execute(plan)
    assert [s.request_id for s in sampled] == ["p", "r"]
    assert sampled[1].token_id == int(hf_logits(large, prompts["r"])[-1].argmax())
    page = plan.batches[1].chunks[1].block_tables[2][0]
    saved = executor.read_page(page)
    executor.write_page(page, bytes(len(saved)))
    assert executor.read_page(page) == bytes(len(saved))
    executor.write_page(page, saved)
    assert executor.read_page(page) == saved


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_close_to_fp32(nested, dtype):
    executor, large = nested
    half = LocalExecutor(executor.family, num_pages=64, page_bytes=1500, dtype=dtype)
    prompt = _prompt(9)
    tables = [list(range(l * 3, l * 3 + 3)) for l in range(3)]
    chunk = SeqChunk(request_id=RequestId("h"), token_ids=prompt, start_pos=0, block_tables=tables, sample=True,
                     sampling=SamplingParams())
    logits = half.model("b").forward(half.arena, [chunk], all_logits=True)
    expected = hf_logits(large, prompt)
    assert logits.dtype == torch.float32
    assert (logits - expected).abs().max() < 0.05 * expected.abs().max()


def test_attention_accepts_a_strided_sdpa_output(setup, monkeypatch):
    """CUDA's fused attention kernels return [seqs, heads, rows, dim] laid out as [seqs, rows, heads, dim];
    the engine must reshape it, not view it (a .view fails the first step on a GPU)."""
    import engines.local.attention as attention

    real = attention.F.scaled_dot_product_attention

    def strided(*args, **kwargs):
        out = real(*args, **kwargs)
        return out.transpose(1, 2).contiguous().transpose(1, 2)      # same values, CUDA's memory order

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", strided)
    executor, model, member = setup
    requests = [_request(f"g{i}", _prompt(n, offset=i)) for i, n in enumerate([1, 6, 13])]   # decode and prefill groups
    run_to_completion(executor, member, requests, PageCounter(NUM_PAGES))
    for request in requests:
        assert request.generated == hf_generate(model, request.prompt, NEW_TOKENS), request.request_id


# ----------------------------------------------------------------------------- the shipped families' own weights
SHIPPED_QUESTIONS = ("What is the capital of France?", "Write a short poem about the sea.",
                     "How do I sort a list in Python?", "Explain prefix caching in two sentences.")
SHIPPED_NEW_TOKENS = 12


@pytest.fixture(scope="module", params=["tiny", "tiny-sep"])
def shipped(request):
    """(family, one executor over one arena for all its members) for a shipped family: `tiny` (nested: the
    engine merges a member into a larger one's forward) and `tiny-sep` (three independent networks)."""
    family = load_family(request.param)
    page_bytes = 16 * max(m.kv_bytes_per_token_per_layer(4) for m in family.members)
    return family, LocalExecutor(family, num_pages=NUM_PAGES * 4, page_bytes=page_bytes, num_threads=1)


def test_shipped_members_greedy_tokens_match_transformers(shipped):
    """Every member of each shipped family, all stepping together in one plan on one arena (each its own batch of
    chat prompts, continuous batching), decodes the tokens LlamaForCausalLM decodes greedily on the same weights."""
    from transformers import LlamaForCausalLM

    from orchestrator.serve.tokenizer import FamilyTokenizer

    family, executor = shipped
    tokenizer = FamilyTokenizer(family.members[0].checkpoint_dir)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in SHIPPED_QUESTIONS]
    requests = {m.name: [EngineRequest(f"{m.name}-{i}", p, SHIPPED_NEW_TOKENS, [[] for _ in range(m.num_layers)])
                         for i, p in enumerate(prompts)] for m in family.members}
    pages = PageCounter(NUM_PAGES * 4)
    while any(not r.done() for rs in requests.values() for r in rs):
        active = {m: [r for r in rs if not r.done()] for m, rs in requests.items()}
        batches = [MemberBatch(m, [next_chunk(r, pages, executor.tokens_per_block(m), None) for r in rs])
                   for m, rs in active.items() if rs]
        sampled = {s.request_id: s.token_id for s in executor.execute(StepPlan(batches=batches))}
        for rs in active.values():
            for r in rs:
                r.generated.append(sampled[r.request_id])
    for member in family.members:
        hf = LlamaForCausalLM.from_pretrained(member.checkpoint_dir, torch_dtype=torch.float32).eval()
        for request in requests[member.name]:
            assert request.generated == hf_generate(hf, request.prompt, SHIPPED_NEW_TOKENS), request.request_id
