"""Properties of the OpenAI API against the real local engine (tiny family), in both engine modes (engine.process
thread and separate), each example a handful of requests sent at once by concurrent asyncio clients:

- a body valid by the published request schema (/openapi.json, orchestrator/serve/openapi_models.py) and by the
  documented rules the schema cannot carry (a model the server lists, token ids inside the vocabulary, prompt +
  max_tokens within the context, min_tokens <= max_tokens, top_logprobs with logprobs) gets a 2xx: a whole answer,
  or a stream ending in [DONE] without an error event; max_tokens reaches up to the rest of the context;
- the same body with ONE field changed to a value the schema (or one of those rules) refuses gets a 4xx whose
  error names that field in `param`;
- a prompt text up to the server's text-length limit (and past it) is answered iff its tokens fit the context,
  else refused naming the field that does not fit.
Afterwards the server is healthy and holds no used KV page. Examples are derandomized (a CI failure reproduces)."""
from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

import httpx
import pytest
from hypothesis import HealthCheck, Phase, assume, given, settings
from hypothesis import strategies as st
from jsonschema import Draft202012Validator

from eval.bench.fuzz_api import ENDPOINTS, from_schema, hostile_values, pages_used_when_idle, request_schemas
from orchestrator.core.config import load_config
from orchestrator.serve.factory import build_serving_engine
from orchestrator.serve.server import ServerSettings, create_app
from tests.fakes_serving import family_dir, serve_in_thread

COMP, CHAT = ENDPOINTS
CLIENTS = 4                       # requests in flight at once, one asyncio client each
SET_LATER = {"max_tokens", "max_completion_tokens", "min_tokens", "top_logprobs", "logprobs", "model"}


@dataclass
class Api:
    mode: str
    url: str
    http: httpx.Client
    tokenizer: object
    family: object
    schemas: dict
    models: list[str]

    @property
    def vocab(self) -> int:
        return self.tokenizer.vocab_size

    def context(self, model: str | None) -> int:
        pinned = model if model and model != self.family.name else None
        return self.family.member(pinned).context_tokens if pinned else self.family.context_tokens()

    def text_limit(self, model: str | None) -> int:
        return self.tokenizer.max_prompt_chars(self.context(model))

    def prompt_tokens(self, path: str, body: dict) -> int:
        """The prompt's length in tokens, from the family's tokenizer (the chat template for chat)."""
        if path == CHAT:
            rendered = [{"role": m["role"], "content": _content_text(m.get("content"))} for m in body["messages"]]
            return len(self.tokenizer.apply_chat_template(rendered, add_generation_prompt=True))
        prompt = body["prompt"]
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        return len(self.tokenizer.encode(prompt)) if isinstance(prompt, str) else len(prompt)


def _content_text(content) -> str:
    if content is None:
        return ""
    return content if isinstance(content, str) else "".join(part["text"] for part in content)


@pytest.fixture(scope="module", params=["thread", "separate"])
def api(request):
    config = load_config(None, {"family": str(family_dir()), "pool.num_pages": 4096, "pool.host_tier_mb": 0,
                                "engine.device": "cpu", "engine.num_threads": 1, "engine.process": request.param})
    engine = build_serving_engine(config)
    app = create_app(engine, engine.tokenizer, engine.family, ServerSettings(request_timeout_s=120))
    with serve_in_thread(app, timeout_s=180) as url, httpx.Client(base_url=url, timeout=120) as http:
        models = [m["id"] for m in http.get("/v1/models").json()["data"]]
        yield Api(request.param, url, http, engine.tokenizer, engine.family, request_schemas(http), models)
        assert http.get("/health").status_code == 200
        assert pages_used_when_idle(http) == 0


def _settings(examples: int, shrink: bool = True):
    """derandomize: the same examples on every run (a CI failure reproduces). Without shrink for the tests whose
    examples generate: shrinking a handful of generations can take hypothesis its five minutes; the failing
    example is reported as drawn."""
    phases = [Phase.explicit, Phase.generate, *([Phase.shrink] if shrink else [])]
    return settings(max_examples=examples, derandomize=True, database=None, deadline=None, phases=phases,
                    suppress_health_check=list(HealthCheck))


# ----------------------------------------------------------------------------- valid bodies from the schema
@st.composite
def valid_request(draw, api: Api, text_max: int = 40, max_tokens_cap: int | None = 16, min_tokens_cap: int = 8):
    """(path, body): every field the schema's, each optional one present or not; then the documented rules:
    a listed model, prompt + max_tokens within the context (max_tokens up to the rest of it when uncapped),
    min_tokens <= max_tokens, top_logprobs only with logprobs."""
    path = draw(st.sampled_from(ENDPOINTS))
    schema = api.schemas[path]
    properties, required = schema["properties"], set(schema["required"])
    body = {name: draw(from_schema(properties[name], name, api.vocab - 1, text_max)) for name in sorted(required)}
    optional = sorted(set(properties) - required - SET_LATER)
    for name in draw(st.lists(st.sampled_from(optional), unique=True, max_size=len(optional))):
        body[name] = draw(from_schema(properties[name], name, api.vocab - 1, text_max))
    if draw(st.booleans()):                      # a stream half the time (its own code path at the edge)
        body["stream"] = True
    if draw(st.booleans()):
        body["model"] = draw(st.sampled_from(api.models))
    budget = api.context(body.get("model")) - api.prompt_tokens(path, body)
    assume(budget >= 1)
    max_tokens = draw(st.integers(1, budget if max_tokens_cap is None else min(budget, max_tokens_cap)))
    for name in draw(st.sampled_from((["max_tokens"], ["max_completion_tokens"],
                                      ["max_tokens", "max_completion_tokens"]))):
        body[name] = max_tokens
    if draw(st.booleans()):
        body["min_tokens"] = draw(st.integers(0, min(max_tokens, min_tokens_cap)))
    if path == CHAT:
        if draw(st.booleans()):
            body["logprobs"] = draw(st.booleans())
        if draw(st.booleans()):
            body["top_logprobs"] = draw(st.integers(0, 20))
            if body["top_logprobs"]:
                body["logprobs"] = True
    elif draw(st.booleans()):
        body["logprobs"] = draw(st.integers(0, 5))
    return path, body


# ----------------------------------------------------------------------------- one field made invalid
def _validator(schema: dict) -> Draft202012Validator:
    return Draft202012Validator(schema)


def boundary_values(schema: dict) -> list:
    """Values just outside a property schema's bounds (and inside the other branches' types)."""
    out = [None, True, 0, -1, 1.5, "x", "", [], {}, [None], ["x"], [1.5], {"a": 1}, [-1], 2**64, -2**63 - 1]
    for branch in schema.get("anyOf", [schema]):
        for key, step in (("minimum", -1), ("maximum", 1), ("exclusiveMinimum", 0)):
            if key in branch:
                out.append(branch[key] + step)
                if branch.get("type") == "number":
                    out.append(branch[key] + step * 0.5)
        if "maxLength" in branch:
            out.append("s" * (branch["maxLength"] + 1))
        if "maxItems" in branch:
            out.append(["a"] * (branch["maxItems"] + 1))
            out.append([1] * (branch["maxItems"] + 1))
        if branch.get("enum") or "const" in branch:
            out.append("no-such-choice")
        if "patternProperties" in branch:                                # logit_bias
            out += [{"x": 1}, {"1": 101}, {"1": "a"}, {"0" * 13: 1}]
        if "properties" in branch:                                       # stream_options
            out += [{name: "x"} for name in branch["properties"]]
        items = branch.get("items", {})
        if "properties" in items:                                        # messages
            out += [[{"role": "robot", "content": "x"}], [{"content": "x"}], [{"role": "user", "content": 5}],
                    [{"role": "user", "content": [{"type": "image_url", "image_url": "u"}]}], ["x"]]
    return out


def invalid_values(schema: dict) -> st.SearchStrategy:
    """Values the property's schema refuses: its boundaries, wrong types, hostile values."""
    validator = _validator(schema)
    candidates = st.one_of(st.sampled_from(boundary_values(schema)), hostile_values())
    return candidates.filter(lambda value: not validator.is_valid(value))


@st.composite
def one_invalid_field(draw, api: Api):
    """(path, body, field): a valid body with one field changed to a value the published schema refuses, a
    required field dropped, or one value that breaks a documented rule the schema cannot carry."""
    path, body = draw(valid_request(api, text_max=20, max_tokens_cap=4))
    schema = api.schemas[path]
    how = draw(st.sampled_from(("schema", "schema", "schema", "rule")))
    if how == "schema":
        field = draw(st.sampled_from(sorted(schema["properties"])))
        if field in schema["required"] and draw(st.booleans()):
            del body[field]
        else:
            body[field] = draw(invalid_values(schema["properties"][field]))
        return path, body, field
    rules = ["model", "stop_token_ids", "logit_bias", "max_tokens", "min_tokens", "text"]
    if path == COMP:
        rules.append("prompt_ids")
    elif not body.get("logprobs"):
        rules.append("top_logprobs")
    rule = draw(st.sampled_from(rules))
    winner = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    if rule == "model":
        body["model"] = draw(st.sampled_from(("no-such-model", api.family.name + "-x", "")).filter(
            lambda m: m not in api.models and m != ""))
        return path, body, "model"
    if rule == "stop_token_ids":
        body["stop_token_ids"] = [draw(st.integers(api.vocab, api.vocab + 10))]
        return path, body, "stop_token_ids"
    if rule == "logit_bias":
        body["logit_bias"] = {str(draw(st.integers(api.vocab, 10**12 - 1))): 1.0}
        return path, body, "logit_bias"
    if rule == "max_tokens":
        body[winner] = api.context(body.get("model")) - api.prompt_tokens(path, body) + draw(st.integers(1, 10**6))
        return path, body, winner
    if rule == "min_tokens":
        body["min_tokens"] = body[winner] + draw(st.integers(1, 100))
        return path, body, "min_tokens"
    if rule == "top_logprobs":
        body["top_logprobs"] = draw(st.integers(1, 20))
        return path, body, "top_logprobs"
    if rule == "prompt_ids":
        body["prompt"] = [draw(st.integers(api.vocab, 2**63 - 1))]
        return path, body, "prompt"
    text = "a" * (api.text_limit(body.get("model")) + 1)       # past the text-length limit, refused untokenized
    if path == COMP:
        body["prompt"] = text
        return path, body, "prompt"
    body["messages"] = [{"role": "user", "content": text}]
    return path, body, "messages"


# ----------------------------------------------------------------------------- sending, concurrently
async def _send(client: httpx.AsyncClient, path: str, body: dict) -> tuple[int, object]:
    """(status, JSON body) or, for a 200 stream, (200, [events]) with [DONE] as the string '[DONE]'."""
    raw = json.dumps(body, allow_nan=False).encode()
    async with client.stream("POST", path, content=raw, headers={"content-type": "application/json"}) as response:
        data = await response.aread()
    if response.status_code == 200 and response.headers.get("content-type", "").startswith("text/event-stream"):
        events = [line[6:] for line in data.decode().split("\n") if line.startswith("data: ")]
        return 200, [e if e == "[DONE]" else json.loads(e) for e in events]
    return response.status_code, json.loads(data)


def send_all(api: Api, requests: list[tuple[str, dict]]) -> list[tuple[int, object]]:
    """The requests at once, one asyncio client (its own connection) each."""
    async def run() -> list[tuple[int, object]]:
        # verify=False: plain http, and no CA bundle loaded per client (~50 ms each)
        clients = [httpx.AsyncClient(base_url=api.url, timeout=120, verify=False) for _ in requests]
        try:
            return await asyncio.gather(*(_send(c, path, body) for c, (path, body) in zip(clients, requests)))
        finally:
            await asyncio.gather(*(c.aclose() for c in clients))
    return asyncio.run(run())


def assert_answered(path: str, body: dict, status: int, answer) -> None:
    where = (path, json.dumps(body)[:600])
    assert status == 200, (status, answer, where)
    max_tokens = body.get("max_completion_tokens") or body["max_tokens"]
    if body.get("stream"):
        assert answer and answer[-1] == "[DONE]", (answer[-3:], where)
        chunks = answer[:-1]
        assert not any("error" in c for c in chunks), (chunks, where)
        finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]
                    and c["choices"][0]["finish_reason"]]
        assert len(finishes) == 1 and finishes[0] in ("stop", "length"), (finishes, where)
        usage = [c["usage"] for c in chunks if c.get("usage")]
        assert len(usage) == bool((body.get("stream_options") or {}).get("include_usage")), where
    else:
        assert answer["choices"][0]["finish_reason"] in ("stop", "length"), (answer, where)
        assert answer["usage"]["completion_tokens"] <= max_tokens, (answer["usage"], where)


def assert_refused(field: str, status: int, answer, where) -> None:
    assert 400 <= status < 500, (status, answer, field, where)
    error = answer["error"]
    assert error["message"] and error["type"], (answer, where)
    assert error["param"] == field, (error, field, where)


# ----------------------------------------------------------------------------- the properties
@pytest.mark.slow              # the one whose examples generate (up to the rest of the context): ~10 s per mode
def test_schema_valid_bodies_get_a_2xx_from_concurrent_clients(api):
    # one request of each handful may ask for up to the whole rest of the context
    requests = st.tuples(valid_request(api, max_tokens_cap=None), *(valid_request(api) for _ in range(CLIENTS - 1)))

    @_settings(10, shrink=False)
    @given(requests)
    def one(batch):
        for (path, body), (status, answer) in zip(batch, send_all(api, list(batch))):
            assert_answered(path, body, status, answer)

    one()
    assert api.http.get("/health").status_code == 200


def test_one_invalid_field_gets_a_4xx_naming_it_from_concurrent_clients(api):
    @_settings(60)
    @given(st.lists(one_invalid_field(api), min_size=CLIENTS, max_size=CLIENTS))
    def one(batch):
        answers = send_all(api, [(path, body) for path, body, _ in batch])
        for (path, body, field), (status, answer) in zip(batch, answers):
            assert_refused(field, status, answer, (path, json.dumps(body, default=str)[:600]))

    one()
    assert api.http.get("/health").status_code == 200


@st.composite
def long_prompt(draw, api: Api):
    """(path, body, expected param or None): a prompt text of up to the text-length limit and a little past it,
    made of vocabulary pieces (so a text near the limit can still fit the context: the longest pieces are ~32
    characters a token), and max_tokens small or exactly at the context's edge (or one past it)."""
    path = draw(st.sampled_from(ENDPOINTS))
    model = draw(st.sampled_from(api.models))
    limit = api.text_limit(model)
    piece = draw(st.one_of(st.just(api.densest_piece), st.sampled_from(api.long_pieces),
                           st.integers(0, api.vocab - 1).map(api.tokenizer.token_text)))
    target = draw(st.one_of(st.sampled_from((limit, limit + 1)), st.integers(limit - 2048, limit),
                            st.integers(1, limit + 64)))
    text = (piece * (target // max(1, len(piece)) + 1))[:target] or "x"
    body = {"model": model}
    if path == COMP:
        body["prompt"] = text
    else:
        cut = draw(st.integers(0, len(text)))
        body["messages"] = [{"role": "system", "content": text[:cut]}, {"role": "user", "content": text[cut:]}]
    field = "prompt" if path == COMP else "messages"
    if len(text) > limit:
        body["max_tokens"] = 1
        return path, body, field
    budget = api.context(model) - api.prompt_tokens(path, body)
    if budget < 1:
        body["max_tokens"] = 1
        return path, body, field
    edge = [budget] if budget <= 64 else []
    body["max_tokens"] = draw(st.sampled_from([1, 2, *edge, budget + 1]))
    return path, body, ("max_tokens" if body["max_tokens"] > budget else None)


def test_prompt_texts_up_to_the_length_limit_are_answered_iff_they_fit_the_context(api):
    vocab = [api.tokenizer.token_text(i) for i in range(api.vocab)]
    api.long_pieces = sorted(vocab, key=len)[-16:]            # the longest pieces: 14-32 characters a token
    # the piece whose repetition packs the most characters into a token (32 spaces: one token each), so a text
    # just under the length limit can still fit the context, and the limit itself is tested from both sides
    api.densest_piece = max(api.long_pieces, key=lambda p: len(p) * 50 / len(api.tokenizer.encode(p * 50)))

    @_settings(25, shrink=False)
    @given(st.lists(long_prompt(api), min_size=2, max_size=2))
    def one(batch):
        answers = send_all(api, [(path, body) for path, body, _ in batch])
        for (path, body, field), (status, answer) in zip(batch, answers):
            if field is None:
                assert_answered(path, body, status, answer)
            else:
                assert_refused(field, status, answer, (path, {k: str(v)[:80] for k, v in body.items()}))

    one()
    assert api.http.get("/health").status_code == 200


@pytest.mark.parametrize("path, field, value", [
    (COMP, "top_k", 2**64 - 1), (COMP, "top_k", 2**64), (COMP, "seed", 2**64 - 1), (COMP, "seed", 2**64),
    (CHAT, "seed", -2**63), (CHAT, "seed", -2**63 - 1), (COMP, "logit_bias", {"5": 1}), (COMP, "logit_bias", {"": 1}),
    (CHAT, "logit_bias", {"a": 1}), (CHAT, "metadata", {"k": "v"}), (CHAT, "metadata", "x"), (COMP, "store", False),
    (COMP, "store", 0), (CHAT, "service_tier", "auto"), (CHAT, "service_tier", 5),
    (COMP, "parallel_tool_calls", "yes"), (COMP, "max_tokens", 0), (CHAT, "max_tokens", 2), (CHAT, "top_p", 1e-300),
])
def test_the_published_schema_and_the_server_agree_on_edge_values(api, path, field, value):
    """An edge value the published schema accepts is answered; one it refuses is a 4xx naming the field (the
    body holds max_completion_tokens beside it: max_tokens is still checked)."""
    body = {"prompt": "hi"} if path == COMP else {"messages": [{"role": "user", "content": "hi"}]}
    body = {**body, "max_completion_tokens": 2, field: value}
    valid = _validator(api.schemas[path]).is_valid(body)
    [(status, answer)] = send_all(api, [(path, body)])
    if valid:
        assert_answered(path, body, status, answer)
    else:
        assert_refused(field, status, answer, (path, body))
