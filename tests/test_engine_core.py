"""EngineCore (the step loop both local serving paths run) with a fake executor: outputs reach their sinks,
a detached request's outputs are dropped, a failed step fails its requests (MFSError) and frees their pages."""
from __future__ import annotations

from orchestrator.core.complexity import ComplexityEstimator
from orchestrator.core.engine_core import EngineCore, drain
from orchestrator.core.errors import MFSError
from orchestrator.core.types import FinishReason, MemberName, Request, RequestId, SamplingParams
from tests.fakes import FakeExecutor, fake_config, fake_vocab, nested_family


class Clock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        self.now_s += 0.01
        return self.now_s


def make_core(**overrides) -> EngineCore:
    return EngineCore(fake_config(**overrides), nested_family(), clock=Clock(),
                      estimator=ComplexityEstimator(fake_vocab()), make_executor=FakeExecutor)


def request(rid: str, max_tokens: int = 5) -> Request:
    return Request(request_id=RequestId(rid), prompt_token_ids=list(range(10, 30)),
                   sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True), arrival_s=0.0,
                   pinned_member=MemberName("m"))


def test_outputs_reach_their_own_sink_and_a_detached_request_is_dropped():
    core = make_core()
    got: dict[str, list] = {"a": [], "b": []}
    core.add_request(request("a"), got["a"].append)
    core.add_request(request("b"), got["b"].append)
    core.detach(RequestId("b"))            # its caller went away without aborting yet
    drain(core, 100)
    assert sum(len(o.new_token_ids) for o in got["a"]) == 5 and got["a"][-1].finished
    assert [o.request_id for o in got["a"]] == ["a"] * len(got["a"])
    assert got["b"] == []
    assert core.num_steps > 0 and core.pool.counts()["used"] == 0


def test_a_failed_step_fails_each_request_once_and_frees_its_pages():
    core = make_core()
    got: list = []
    core.add_request(request("a", max_tokens=50), got.append)
    core.step()                                    # admitted: it holds pages now
    assert core.pool.counts()["used"] > 0

    def broken(plan):
        raise RuntimeError("device lost")
    core.executor.execute = broken
    steps = iter([True, False])
    core.run(lambda: next(steps), on_step_error=lambda exc: got.append(("logged", str(exc))))
    assert core.last_error == "RuntimeError: device lost"
    assert got[-2] == ("logged", "device lost")
    assert isinstance(got[-1], MFSError) and "engine step failed: RuntimeError: device lost" in str(got[-1])
    before = len(got)
    drain(core, 100)                           # the abort is processed: pages back, nothing more delivered
    assert len(got) == before and core.pool.counts()["used"] == 0


def test_abort_with_stop_finishes_the_request():
    core = make_core()
    got: list = []
    core.add_request(request("a", max_tokens=50), got.append)
    core.step()
    core.abort(RequestId("a"), finish_reason=FinishReason.STOP)
    drain(core, 100)
    assert got[-1].finished and got[-1].finish_reason is FinishReason.STOP
