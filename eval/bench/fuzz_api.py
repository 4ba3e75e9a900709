"""Hostile-input run against `mfs serve`: request bodies generated from the served /openapi.json, then mutated.

Bodies for both generation endpoints come from the schema the server publishes (hypothesis strategies built
from it), streaming and not; then one of: a field replaced by a hostile value (huge or negative numbers, wrong
types, deep nesting, long unicode), unknown fields added, a required field dropped, the encoded bytes cut or
corrupted, or raw garbage (random bytes, arrays nested 10^5 deep, numbers of 400 digits). Every answer is
classified: 2xx (a whole answer, a stream ending in [DONE]), 4xx (with an OpenAI error body), or a failure: 5xx,
a 4xx without an error body, an error event inside a stream, a dropped connection. Afterwards the server must be
healthy, hold no used KV page, and answer a fixed greedy request with the same text as before.

    python -m eval.bench.fuzz_api --requests 5000          # starts its own mfs serve on the tiny family
    python -m eval.bench.fuzz_api --url http://127.0.0.1:8000 --requests 500
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections import Counter

import httpx
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
GREEDY = {"model": "tiny-l", "prompt": "The river runs past the old mill and", "max_tokens": 12, "temperature": 0}
_SMALL_INTS = {"max_tokens", "max_completion_tokens", "min_tokens"}     # keep valid answers short
TOKEN_ID_FIELDS = {"prompt", "stop_token_ids"}
FAILURES = ("5xx", "4xx_without_error_body", "stream_error", "dropped")


# ----------------------------------------------------------------------------- bodies from the schema
def from_schema(schema: dict, name: str = "", max_token_id: int = 4096 + 2, text_max: int = 40) -> st.SearchStrategy:
    """A strategy for the JSON Schema subset pydantic emits (anyOf, const, enum, scalar bounds, arrays, objects):
    token ids (TOKEN_ID_FIELDS, logit_bias keys) in [0, max_token_id] (the vocabulary's for valid bodies, a few past
    it for hostile ones), texts of at most text_max characters, the fields of _SMALL_INTS at most 8."""
    def inner(sub: dict, field: str = name) -> st.SearchStrategy:
        return from_schema(sub, field, max_token_id, text_max)
    if "anyOf" in schema:
        return st.one_of([inner(s) for s in schema["anyOf"]])
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    kind = schema.get("type")
    if kind == "null":
        return st.none()
    if kind == "boolean":
        return st.booleans()
    if kind == "integer":
        low, high = schema.get("minimum"), schema.get("maximum")
        if name in _SMALL_INTS:
            high = 8
        if name in TOKEN_ID_FIELDS:
            high = max_token_id
        return st.integers(None if low is None else int(low), None if high is None else int(high))
    if kind == "number":
        exclusive = "exclusiveMinimum" in schema
        low = schema.get("exclusiveMinimum", schema.get("minimum"))
        return st.floats(low, schema.get("maximum"), allow_nan=False, allow_infinity=False, exclude_min=exclusive)
    if kind == "string":
        if "pattern" in schema:                  # logit_bias keys: token ids
            return st.integers(0, max_token_id).map(str)
        return st.text(min_size=schema.get("minLength", 0), max_size=min(schema.get("maxLength", text_max), text_max))
    if kind == "array":
        return st.lists(inner(schema.get("items", {})), min_size=schema.get("minItems", 0),
                        max_size=min(schema.get("maxItems", 4), 4))
    if kind == "object" or "properties" in schema:
        properties = schema.get("properties", {})
        extra = schema.get("additionalProperties")
        if not properties and schema.get("patternProperties"):      # logit_bias: token id -> bias
            (pattern, values), = schema["patternProperties"].items()
            assert pattern == "^[0-9]{1,12}$", pattern
            return st.dictionaries(st.integers(0, max_token_id).map(str), inner(values),
                                   max_size=min(schema.get("maxProperties", 4), 4))
        if not properties and isinstance(extra, dict):
            return st.dictionaries(inner(schema.get("propertyNames", {"type": "string"})), inner(extra), max_size=4)
        if not properties:                       # free-form (metadata)
            return st.dictionaries(st.text(max_size=8), json_values(), max_size=3)
        required = set(schema.get("required", ()))
        strategies = {k: inner(v, k) for k, v in properties.items()}
        return st.fixed_dictionaries({k: s for k, s in strategies.items() if k in required},
                                     optional={k: s for k, s in strategies.items() if k not in required})
    return json_values()


def json_values() -> st.SearchStrategy:
    scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False, allow_infinity=False),
                        st.text(max_size=30))
    return st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                         st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                        max_leaves=12)


def hostile_values() -> st.SearchStrategy:
    deep = st.integers(10, 200).map(lambda n: json.loads("[" * n + "]" * n))
    return st.one_of(
        st.integers(2**63 - 2, 2**63 + 2), st.integers(-2**64, -1), st.integers(2**64, 2**200),
        st.sampled_from([1e308, -1e308, 5e-324, -0.0, 0.0, 1, -1, 2, 100, 101, -101, 4096, 4097]),
        st.text(max_size=2000), st.text(alphabet="\u0000\u202e\ud7ff\ufeff\U0001f600\u00e9", max_size=50),
        json_values(), deep, st.lists(st.integers(), max_size=300))


@st.composite
def hostile_request(draw, schemas: dict[str, dict], vocab_size: int) -> tuple[str, bytes]:
    """(path, raw body): a schema body, often mutated, or garbage."""
    path = draw(st.sampled_from(ENDPOINTS))
    body = draw(from_schema(schemas[path], max_token_id=vocab_size + 2))   # a few ids past the vocabulary
    if "max_tokens" not in body and "max_completion_tokens" not in body:
        body["max_tokens"] = draw(st.integers(1, 8))        # chat's default is the rest of the context: too slow
    how = draw(st.sampled_from(("valid", "replace", "replace", "unknown", "drop", "bytes", "garbage")))
    if how == "replace":
        body[draw(st.sampled_from(sorted(schemas[path]["properties"])))] = draw(hostile_values())
    elif how == "unknown":
        body[draw(st.text(min_size=1, max_size=20))] = draw(hostile_values())
    elif how == "drop":
        body.pop("prompt", None)
        body.pop("messages", None)
    raw = json.dumps(body, ensure_ascii=draw(st.booleans())).encode()
    if how == "bytes":
        cut = draw(st.integers(0, len(raw)))
        raw = raw[:cut] + draw(st.binary(max_size=8)) + raw[cut + draw(st.integers(0, 3)):]
    elif how == "garbage":
        depth = draw(st.sampled_from((50, 1000, 5000, 100_000)))
        raw = draw(st.one_of(
            st.binary(max_size=300),
            st.just(b"[" * depth + b"]" * depth), st.just(b'{"prompt": ' + b"[" * depth + b"]" * depth + b"}"),
            st.just(b'{"messages": [{"role": "user", "content": ' + b"{\"a\":" * depth + b"1" + b"}" * depth + b"}]}"),
            st.just(b'{"prompt": "x", "max_tokens": 1' + b"0" * 400 + b"}"),
            st.just(b'{"prompt": "x", "temperature": 1e400}'), st.just(b'{"prompt": "x", "top_p": NaN}'),
            st.just(b'{"prompt": "\\ud800"}'), st.just(b"\xff\xfe{}")))
    return path, raw


# ----------------------------------------------------------------------------- one exchange
def exchange(http: httpx.Client, path: str, raw: bytes) -> str:
    """Sends one raw body; returns '2xx', '4xx' or a failure name (FAILURES)."""
    try:
        with http.stream("POST", path, content=raw, headers={"content-type": "application/json"}) as response:
            body = response.read()
    except httpx.TransportError:
        return "dropped"
    if response.status_code >= 500:
        return "5xx"
    if response.status_code >= 400:
        try:
            error = json.loads(body)["error"]
            return "4xx" if error["message"] and "type" in error else "4xx_without_error_body"
        except (ValueError, KeyError, TypeError):
            return "4xx_without_error_body"
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        events = [line for line in body.decode().split("\n") if line.startswith("data: ")]
        ok = events and events[-1] == "data: [DONE]" and not any(e.startswith('data: {"error"') for e in events)
        return "2xx" if ok else "stream_error"
    return "2xx"


def request_schemas(http: httpx.Client) -> dict[str, dict]:
    document = http.get("/openapi.json").json()
    return {path: document["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
            for path in ENDPOINTS}


def greedy_text(http: httpx.Client) -> str:
    response = http.post("/v1/completions", json=GREEDY)
    response.raise_for_status()
    return response.json()["choices"][0]["text"]


def pages_used_when_idle(http: httpx.Client, timeout_s: float = 30.0) -> int:
    deadline = time.monotonic() + timeout_s
    while True:
        used = http.get("/v1/stats").json()["pages"]["by_state"]["used"]
        if used == 0 or time.monotonic() > deadline:
            return used
        time.sleep(0.2)


def run(url: str, num_requests: int, seed: int | None, vocab_size: int = 4096) -> dict:
    """num_requests hostile exchanges on ONE keep-alive client (a dropped connection shows); returns the counts."""
    counts: Counter = Counter()
    with httpx.Client(base_url=url, timeout=120) as http:
        schemas = request_schemas(http)
        before = greedy_text(http)

        @settings(max_examples=num_requests, deadline=None, database=None, phases=[Phase.generate],
                  suppress_health_check=list(HealthCheck))
        @given(hostile_request(schemas, vocab_size))
        def one(request) -> None:
            counts[exchange(http, *request)] += 1

        one = hypothesis_seed(seed)(one) if seed is not None else one
        one()
        healthy = http.get("/health").status_code == 200
        used = pages_used_when_idle(http)
        after = greedy_text(http)
    return {"requests": sum(counts.values()), **{k: counts[k] for k in ("2xx", "4xx", *FAILURES)},
            "healthy_after": healthy, "pages_used_after": used, "greedy_text_unchanged": before == after}


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m eval.bench.fuzz_api", description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--url", help="an mfs serve already running (default: start one on the tiny family)")
    parser.add_argument("--seed", type=int, help="hypothesis seed (default: random)")
    args = parser.parse_args()
    seed = args.seed if args.seed is not None else random.randrange(2**32)
    if args.url:
        result = run(args.url, args.requests, seed)
    else:
        from pathlib import Path
        import tempfile

        from eval.bench.soak import free_port, start_server, wait_ready
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        proc = start_server(port, Path(tempfile.mkdtemp()) / "fuzz_server.log")
        try:
            wait_ready(url, proc)
            result = run(url, args.requests, seed)
        finally:
            proc.terminate()
            proc.wait(60)
    print(json.dumps({"seed": seed, **result}, indent=1))
    failed = sum(result[k] for k in FAILURES) or not result["healthy_after"] or result["pages_used_after"] \
        or not result["greedy_text_unchanged"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
