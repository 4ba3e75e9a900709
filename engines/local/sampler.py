"""Per-request token sampling (greedy, temperature, top-k/p, seeds, min_tokens, penalties, bias); raw-model logprobs."""
from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

from orchestrator.core.errors import InvalidRequestError, MFSError
from orchestrator.core.types import RequestId, SampledToken, SamplingParams, SeqChunk


# Below this temperature a request samples greedily (as vLLM does): dividing logits by a temperature near zero
# overflows to inf and the softmax to NaN.
MIN_SAMPLING_TEMPERATURE = 1e-5


def _step_seed(seed: int, num_generated: int) -> int:
    """A generator seed per (request seed, step): a recomputed request draws exactly the same tokens."""
    digest = hashlib.blake2b(f"{seed}:{num_generated}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


class Sampler:
    """Owns one torch.Generator per request (kept until release) on the logits' device."""

    def __init__(self, device: str | torch.device = "cpu") -> None:
        self.device = torch.device(device)
        self._generators: dict[RequestId, torch.Generator] = {}
        # the tokens generated so far by each request with penalties (index = generation step): a rollback or a
        # recompute samples step g again, and the list is cut back to g first
        self._generated: dict[RequestId, list[int]] = {}
        self.faults: dict[RequestId, MFSError] = {}     # the requests whose own sampling failed (fault)

    def release(self, request_ids: Sequence[RequestId]) -> None:
        for request_id in request_ids:
            self._generators.pop(request_id, None)
            self._generated.pop(request_id, None)

    def start_stream(self, request_id: RequestId, seed: int) -> None:
        """Starts an unseeded request's random stream from `seed` instead of fresh entropy: measurements and
        tests that draw many requests reproducibly (the draws are still the request's own stream)."""
        self._generators[request_id] = torch.Generator(device=self.device).manual_seed(seed)

    def generator(self, chunk: SeqChunk) -> torch.Generator:
        """The request's generator; a seeded request's is reseeded for its step (chunk.num_generated)."""
        generator = self._generators.get(chunk.request_id)
        if generator is None:
            generator = torch.Generator(device=self.device)
            if chunk.sampling.seed is None:
                generator.seed()                     # unseeded: fresh entropy once, then a stream per request
            self._generators[chunk.request_id] = generator
        if chunk.sampling.seed is not None:
            generator.manual_seed(_step_seed(chunk.sampling.seed, chunk.num_generated))
        return generator

    def sample(self, logits: torch.Tensor, chunks: Sequence[SeqChunk],
               eos_token_ids: Sequence[int] = ()) -> list[SampledToken]:
        """logits [len(chunks), vocab] float32, one row per sampling chunk; returns one token per row, in order,
        but for a request whose own part failed (its penalties, bias or bans, its draw): that one gets no token
        and its error is kept in `faults`, the others are sampled exactly as they would have been."""
        if not chunks:
            return []
        logits = logits.float()
        try:
            processed = self.adjust(logits, chunks, eos_token_ids)
        except Exception as exc:
            if len(chunks) == 1:
                self.fault(chunks[0], exc, logits.shape[-1])
                return []
            # one request's input broke the batched adjustment, before any draw: each row alone finds which
            return [token for row in range(len(chunks))
                    for token in self.sample(logits[row:row + 1], chunks[row:row + 1], eos_token_ids)]
        drawn = [row for row, chunk in enumerate(chunks) if chunk.sampling.temperature >= MIN_SAMPLING_TEMPERATURE]
        chosen = None                                              # all greedy, nothing adjusted: the raw top-1
        failed: list[int] = []
        if processed is not logits or drawn:
            chosen = processed.argmax(dim=-1)                      # a banned token may be the raw top-1
            for row in drawn:
                try:
                    chosen[row] = self.draw(self.distribution(processed[row], chunks[row].sampling), chunks[row])
                except Exception as exc:                           # its own draw: the others' are unaffected
                    self.fault(chunks[row], exc, logits.shape[-1])
                    failed.append(row)
        if failed:
            kept = [row for row in range(len(chunks)) if row not in failed]
            logits, chosen, chunks = logits[kept], chosen[kept], [chunks[row] for row in kept]
            if not chunks:
                return []
        tokens = self.tokens(logits, chunks, chosen)
        for chunk, token in zip(chunks, tokens):
            if chunk.sampling.penalized:
                self.record(chunk.request_id, chunk.num_generated, [token.token_id])
        return tokens

    def fault(self, chunk: SeqChunk, exc: Exception, vocab: int) -> None:
        """Keeps a request's own sampling error for the executor (take_faults): the request's input (a token id
        outside the model's vocabulary: a 400) or the server's (a 500)."""
        bias_ids = [token for token, _ in chunk.sampling.logit_bias]
        for param, ids in (("logit_bias", bias_ids), ("stop_token_ids", chunk.sampling.stop_token_ids)):
            if any(not 0 <= t < vocab for t in ids):
                self.faults[chunk.request_id] = InvalidRequestError(
                    f"{param} names token ids outside the model's vocabulary [0, {vocab})", param)
                return
        self.faults[chunk.request_id] = MFSError(f"sampling failed for this request: {type(exc).__name__}: {exc}")

    def take_faults(self) -> dict[RequestId, MFSError]:
        """The requests whose own sampling failed since the last call, with their errors."""
        faults, self.faults = self.faults, {}
        return faults

    def adjust(self, logits: torch.Tensor, chunks: Sequence[SeqChunk],
               eos_token_ids: Sequence[int] = ()) -> torch.Tensor:
        """logits [rows, vocab] float32 -> the logits sampling chooses from: penalties and bias applied (each row
        against its request's history before chunk.num_generated), EOS and stop tokens banned before min_tokens.
        Returns `logits` itself when no row needs a change."""
        processed = logits
        penalized = [row for row, chunk in enumerate(chunks) if chunk.sampling.penalized]
        if penalized:
            processed = logits.clone()
            processed[penalized] = self._penalize(logits[penalized], [chunks[row] for row in penalized])
        for row, chunk in enumerate(chunks):
            if chunk.num_generated < chunk.sampling.min_tokens:
                banned = list(eos_token_ids) + list(chunk.sampling.stop_token_ids)
                if banned:
                    processed = processed.clone() if processed is logits else processed
                    processed[row, banned] = float("-inf")
        return processed

    def tokens(self, logits: torch.Tensor, chunks: Sequence[SeqChunk],
               chosen: torch.Tensor | None = None) -> list[SampledToken]:
        """The SampledTokens of `chosen` [rows] (None: each row's raw top-1), with the raw model's logprobs
        (temperature 1, unfiltered: the confidence signal), top-1 probability and top alternatives."""
        log_norm = torch.logsumexp(logits, dim=-1, keepdim=True)          # log p = logit - logsumexp
        best, top1 = logits.max(dim=-1)                            # one pass: the raw top-1 and its id
        top1_logprobs = best - log_norm[:, 0]
        top1_probs = top1_logprobs.exp()
        if chosen is None:
            chosen, chosen_logprobs = top1, top1_logprobs
        else:
            chosen_logprobs = (logits.gather(1, chosen[:, None]) - log_norm)[:, 0]
        num_top = max(c.sampling.num_top_logprobs for c in chunks)
        top_values = top_ids = None
        if num_top > 0:
            top_values, top_ids = logits.topk(min(num_top, logits.shape[-1]), dim=-1)
            top_values, top_ids = (top_values - log_norm).tolist(), top_ids.tolist()
        chosen_list, logprob_list, top1_list = chosen.tolist(), chosen_logprobs.tolist(), top1_probs.tolist()
        tokens = []
        for row, chunk in enumerate(chunks):
            k = chunk.sampling.num_top_logprobs
            alternatives = tuple(zip(top_ids[row][:k], top_values[row][:k])) if k > 0 else ()
            tokens.append(SampledToken(request_id=chunk.request_id, token_id=chosen_list[row],
                                       logprob=logprob_list[row], top1_prob=top1_list[row],
                                       top_logprobs=alternatives, num_drafted=0))
        return tokens

    def record(self, request_id: RequestId, num_generated: int, token_ids: Sequence[int]) -> None:
        """The request's history (what its penalties count) from generation step num_generated on is token_ids:
        a rollback, a recompute or a rejected draft samples those steps again, and the list is cut back first."""
        history = self._generated.setdefault(request_id, [])
        del history[num_generated:]
        history.extend(token_ids)

    def _penalize(self, logits: torch.Tensor, chunks: Sequence[SeqChunk]) -> torch.Tensor:
        """logits [rows, vocab] of requests with penalties or a bias -> adjusted logits, as vLLM defines them: the
        bias is added; a token seen in the prompt or the output has a positive logit divided by
        repetition_penalty and a negative one multiplied by it; then frequency_penalty x (its count in the
        output) and presence_penalty x (whether it is in the output) are subtracted."""
        device, vocab = logits.device, logits.shape[-1]
        params = [c.sampling for c in chunks]
        out = logits.clone()
        bias_rows = [row for row, p in enumerate(params) for _ in p.logit_bias]
        if bias_rows:
            ids = torch.tensor([t for p in params for t, _ in p.logit_bias], device=device)
            values = torch.tensor([b for p in params for _, b in p.logit_bias], device=device, dtype=out.dtype)
            out.index_put_((torch.tensor(bias_rows, device=device), ids), values, accumulate=True)
        histories = [self._generated.get(c.request_id, [])[:c.num_generated] for c in chunks]
        counts = _bin_counts(histories, len(chunks), vocab, device)            # [rows, vocab] float
        in_output = counts > 0
        repetition = torch.tensor([p.repetition_penalty for p in params], device=device, dtype=out.dtype)[:, None]
        if any(p.repetition_penalty != 1.0 for p in params):
            seen = in_output | (_bin_counts([list(p.penalized_prompt_ids) for p in params], len(chunks), vocab,
                                            device) > 0)
            out = torch.where(seen, torch.where(out > 0, out / repetition, out * repetition), out)
        frequency = torch.tensor([p.frequency_penalty for p in params], device=device, dtype=out.dtype)[:, None]
        presence = torch.tensor([p.presence_penalty for p in params], device=device, dtype=out.dtype)[:, None]
        return out - frequency * counts - presence * in_output.to(out.dtype)

    @staticmethod
    def distribution(row_logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        """row_logits [vocab] (adjusted) -> the probabilities a sampled request draws from: temperature, then
        top-k and top-p."""
        scaled = row_logits / params.temperature
        if 0 < params.top_k < scaled.shape[-1]:
            threshold = scaled.topk(params.top_k).values[-1]
            scaled = scaled.masked_fill(scaled < threshold, float("-inf"))
        if params.top_p < 1.0:
            sorted_logits, order = scaled.sort(descending=True)
            sorted_probs = sorted_logits.softmax(-1)
            # drop a token when the tokens ranked above it already reach top_p (the best one always stays)
            drop_sorted = (sorted_probs.cumsum(-1) - sorted_probs) >= params.top_p
            drop_sorted[0] = False            # also when top_p rounds to 0 in float32 (5e-324)
            drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
            scaled = scaled.masked_fill(drop, float("-inf"))
        return scaled.softmax(-1)

    def draw(self, probs: torch.Tensor, chunk: SeqChunk) -> torch.Tensor:
        """probs [vocab] -> a token id (0-d tensor) from the request's generator (a seeded request's generator is
        reseeded for its step, chunk.num_generated)."""
        return torch.multinomial(probs, 1, generator=self.generator(chunk))[0]


def _bin_counts(token_lists: list[list[int]], rows: int, vocab: int, device: torch.device) -> torch.Tensor:
    """[rows, vocab] float: how often each token id occurs in each row's list (padding counts zero)."""
    counts = torch.zeros(rows, vocab, device=device)
    width = max((len(tokens) for tokens in token_lists), default=0)
    if width == 0:
        return counts
    ids = torch.tensor([tokens + [0] * (width - len(tokens)) for tokens in token_lists], device=device)
    valid = torch.tensor([[1.0] * len(tokens) + [0.0] * (width - len(tokens)) for tokens in token_lists],
                         device=device)
    return counts.scatter_add_(1, ids, valid)
