"""A fault in one request's own sampling (its draw, its penalties or bias, its verify) fails that request alone, on
the real local engine and the shipped tiny family: its sink gets a 500-class error (a 400-class one when its input
is at fault), its pages return, and the requests beside it in the same steps produce exactly the tokens they produce
without it. A fault of the batched forward still fails every request, and the thread-mode server's /health turns
503 while such steps keep failing."""
from __future__ import annotations

import itertools
import time

import httpx

from orchestrator.core.config import load_config
from orchestrator.core.engine_core import EngineCore, drain
from orchestrator.core.errors import EngineUnavailableError, MFSError
from orchestrator.core.types import MemberName, Request, RequestId, SamplingParams
from orchestrator.serve.local_engine import local_executor_factory
from orchestrator.serve.tokenizer import family_estimator

PROMPTS = {"g": [5, 17, 42, 99, 7, 311, 12, 64], "s": list(range(30, 75)), "bad": [9, 9, 9, 120, 400, 33]}
MAX_TOKENS = 12


def _core(**overrides) -> EngineCore:
    config = load_config(overrides={"family": "tiny", "pool.num_pages": 256, "pool.host_tier_mb": 0,
                                    "escalation.enabled": False, "engine.num_threads": 1, **overrides})
    ticks = itertools.count()
    core = EngineCore(config, clock=lambda: float(next(ticks)) * 1e-3, estimator=family_estimator,
                      make_executor=local_executor_factory(config))
    core.scheduler.speculation.use_step_cost(None)       # a fixed draft length, whatever this machine's timings
    return core


def _request(rid: str, member: str | None = "tiny-m", complexity: float | None = None, **sampling) -> Request:
    return Request(request_id=RequestId(rid), prompt_token_ids=PROMPTS[rid], arrival_s=0.0,
                   sampling=SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, **sampling),
                   pinned_member=MemberName(member) if member else None, complexity_hint=complexity)


def _run(core: EngineCore, requests: list[Request]) -> dict[str, list]:
    """Each request's items (outputs and errors) as its sink got them, all added before the first step."""
    got: dict[str, list] = {}
    for request in requests:
        got[request.request_id] = []
        core.add_request(request, got[request.request_id].append)
    drain(core, 300)
    return got


def _tokens(items: list) -> list[int]:
    return [t for item in items if not isinstance(item, MFSError) for t in item.new_token_ids]


def _fails_at(method, rid: str, num_generated: int, chunk_of=lambda args: args[-1]):
    """`method` (a sampling step of one request's chunk: chunk_of its arguments), raising for request `rid` from
    its num_generated-th token on."""
    def faulty(*args):
        chunk = chunk_of(args)
        if chunk.request_id == rid and chunk.num_generated >= num_generated:
            raise RuntimeError("injected sampling fault")
        return method(*args)
    return faulty


def _assert_failed_alone(core: EngineCore, items: list, status_code: int, text: str) -> None:
    errors = [item for item in items if isinstance(item, MFSError)]
    assert len(errors) == 1 and items[-1] is errors[0], items           # one error, the request's last item
    assert errors[0].status_code == status_code and text in errors[0].message, errors[0].message
    assert not any(getattr(item, "finished", False) for item in items[:-1])
    assert core.failed_steps == 0 and core.last_error is None          # the step itself went on
    assert not core.has_work() and core.pool.num_used_pages() == 0      # every page came back


def test_a_request_whose_draw_fails_fails_alone_and_the_others_keep_their_tokens():
    others = [_request("g"), _request("s", temperature=1.0, seed=5)]     # greedy, and a seeded draw beside it
    alone = _run(_core(), others)
    core = _core()
    core.executor.sampler.draw = _fails_at(core.executor.sampler.draw, "bad", 2)
    got = _run(core, [*others, _request("bad", temperature=0.8, seed=3)])
    assert _tokens(got["g"]) == _tokens(alone["g"]) and len(_tokens(alone["g"])) == MAX_TOKENS
    assert _tokens(got["s"]) == _tokens(alone["s"]) and len(_tokens(alone["s"])) == MAX_TOKENS
    assert got["g"][-1].finished and got["s"][-1].finished
    assert len(_tokens(got["bad"])) == 2                                 # its tokens before the fault
    _assert_failed_alone(core, got["bad"], 500, "sampling failed for this request: RuntimeError: injected")


def test_a_logit_bias_outside_the_models_vocabulary_fails_its_request_with_a_400():
    """The batched penalties fail for one row: each row is adjusted alone, and the one at fault is told why."""
    alone = _run(_core(), [_request("g", frequency_penalty=0.5)])
    core = _core()
    vocab = core.executor.models["tiny-m"].config.vocab_size
    got = _run(core, [_request("g", frequency_penalty=0.5), _request("bad", logit_bias=((vocab + 7, 3.0),))])
    assert _tokens(got["g"]) == _tokens(alone["g"]) and got["g"][-1].finished
    _assert_failed_alone(core, got["bad"], 400, "logit_bias names token ids outside the model's vocabulary")
    assert got["bad"][-1].param == "logit_bias" and _tokens(got["bad"]) == []


def test_a_verify_that_fails_fails_its_request_alone(monkeypatch):
    """With speculation, a drafting request whose verification raises fails alone; the others' verifies go on."""
    import engines.local.executor as executor_module

    overrides = {"speculation.enabled": True, "speculation.fixed_k": 3}
    others = [_request("g", member=None, complexity=0.95), _request("s", member=None, complexity=0.95)]
    alone = _run(_core(**overrides), others)
    monkeypatch.setattr(executor_module, "accept", _fails_at(executor_module.accept, "bad", 1,
                                                              chunk_of=lambda args: args[2][0]))
    core = _core(**overrides)
    got = _run(core, [*others, _request("bad", member=None, complexity=0.95)])
    assert {rid: _tokens(got[rid]) for rid in ("g", "s")} == {rid: _tokens(alone[rid]) for rid in ("g", "s")}
    assert core.snapshot()["counters"]["drafted_tokens"]["tiny-s->tiny-l"] > 0
    _assert_failed_alone(core, got["bad"], 500, "sampling failed for this request: RuntimeError: injected")


def test_a_forward_that_fails_fails_every_request_of_the_step():
    """A fault no request can be blamed for (the batched forward) fails them all, as a failed step: 503s."""
    core = _core()
    got = {rid: [] for rid in ("g", "s")}
    for rid in got:
        core.add_request(_request(rid), got[rid].append)
    model = core.executor.models["tiny-m"]

    def lost(*args, **kwargs):
        raise RuntimeError("device lost (injected)")
    model.forward = lost
    core.step_or_fail()
    assert core.failed_steps == 1 and "device lost" in core.last_error
    for items in got.values():
        assert len(items) == 1 and isinstance(items[0], EngineUnavailableError) and items[0].status_code == 503
    drain(core, 10)
    assert core.pool.num_used_pages() == 0


def test_thread_mode_health_turns_503_while_steps_keep_failing_and_not_for_a_request_fault():
    """engine.process: thread (LocalServing.health_problem): a request whose sampling fails gets a 500 and the
    server stays healthy; steps that keep failing turn /health 503 with the reason, and a good step heals it."""
    from orchestrator.serve.serving import LocalServing
    from orchestrator.serve.server import ServerSettings, create_app
    from tests.fakes_serving import family_dir, serve_in_thread

    config = load_config(None, {"family": str(family_dir()), "pool.num_pages": 256, "pool.host_tier_mb": 0,
                                "engine.device": "cpu", "engine.num_threads": 1, "engine.process": "thread",
                                "escalation.enabled": False})
    engine = LocalServing(config)
    app = create_app(engine, engine.tokenizer, engine.family, ServerSettings(request_timeout_s=60))

    def post(**body) -> httpx.Response:
        return httpx.post(url + "/v1/completions", json={"model": "tiny-s", "prompt": "The river", "max_tokens": 4,
                                                         **body}, timeout=60)
    with serve_in_thread(app, timeout_s=180) as url:
        sampler = engine.core.executor.sampler
        real_draw = sampler.draw

        def broken_draw(probs, chunk):
            raise RuntimeError("injected sampling fault")
        sampler.draw = broken_draw
        response = post(temperature=1.0)
        assert response.status_code == 500, response.text
        error = response.json()["error"]
        assert error["type"] == "internal_error" and "sampling failed for this request" in error["message"]
        assert post(temperature=0).status_code == 200                       # greedy: no draw, no fault
        assert httpx.get(url + "/health").status_code == 200 and engine.core.failed_steps == 0
        sampler.draw = real_draw

        model = engine.core.executor.models["tiny-s"]

        def lost(*args, **kwargs):
            raise RuntimeError("device lost (injected)")
        model.forward = lost
        deadline = time.monotonic() + 60
        while httpx.get(url + "/health").status_code == 200 and time.monotonic() < deadline:
            assert post().status_code == 503
        health = httpx.get(url + "/health")
        assert health.status_code == 503 and health.json()["status"] == "unhealthy"
        assert "engine steps failed in a row; the last: RuntimeError: device lost" in health.json()["reason"]
        del model.forward                                                   # the device is back
        assert post().status_code == 200
        assert httpx.get(url + "/health").status_code == 200
