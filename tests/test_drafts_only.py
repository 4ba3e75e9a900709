"""A drafts_only member: resident to draft for the larger members, routed no request, no deployment of its own."""
from __future__ import annotations

import dataclasses
import json

import pytest

from orchestrator.core.config import RouterConfig
from eval.baseline.tier_parts import host_tier_lineages
from orchestrator.core.errors import ModelNotFoundError
from orchestrator.core.family import FamilyError, FamilySpec
from orchestrator.core.router import MemberLoad, Router
from orchestrator.core.types import MemberName, Request, RequestId, SamplingParams
from tests.fakes import fake_member


def drafted_family(flag: object = True, on: int = 0) -> FamilySpec:
    members = [fake_member(n, i, d, tuple(f"{n}{l}" for l in range(d))) for i, (n, d) in
               enumerate((("d", 2), ("m", 4), ("l", 6)))]
    members[on] = dataclasses.replace(members[on], serving={"drafts_only": flag})
    return FamilySpec(name="drafted", members=tuple(members))


def request(pinned: str | None = None) -> Request:
    return Request(request_id=RequestId("r"), prompt_token_ids=list(range(50)), sampling=SamplingParams(),
                   arrival_s=0.0, pinned_member=MemberName(pinned) if pinned else None)


def test_only_the_smallest_member_may_draft_only_and_some_member_must_serve():
    family = drafted_family()
    assert family.member_names == ["d", "m", "l"] and family.serving_names == ["m", "l"]
    assert family.member("d").drafts_only and not family.member("m").drafts_only
    with pytest.raises(FamilyError, match="only the smallest member"):
        drafted_family(on=1)
    with pytest.raises(FamilyError, match="true or false"):
        drafted_family(flag="yes")
    only = dataclasses.replace(fake_member("d", 0, 2, ("a", "b")), serving={"drafts_only": True})
    with pytest.raises(FamilyError, match="every member is drafts_only"):
        FamilySpec(name="alone", members=(only,))


def test_the_router_never_sends_a_request_to_the_drafter_even_when_the_others_are_saturated():
    family = drafted_family()
    router = Router(family, RouterConfig())
    busy = MemberLoad(num_running=500, num_waiting=500, running_tokens=10**7, queued_tokens=10**7,
                      expected_delay_s=60.0)
    idle = MemberLoad(num_running=0, num_waiting=0, running_tokens=0, queued_tokens=0)
    loads = {"d": idle, "m": busy, "l": busy}
    for complexity in (0.0, 0.2, 0.39, 0.4, 0.7, 1.0):
        decision = router.route(request(), complexity=complexity, matched_prefix_tokens={"d": 50},
                                loads=loads, session_member="d")
        assert decision.member in ("m", "l") and "d" not in decision.scores
    # the serving members' bands are the router's thresholds, as in a family without the drafter
    assert [router.adequate_member(c) for c in (0.0, 0.39, 0.4, 1.0)] == ["m", "m", "l", "l"]
    with pytest.raises(ValueError, match="only drafts"):
        router.route(request(pinned="d"), complexity=0.5, matched_prefix_tokens={}, loads=loads, session_member=None)


def test_the_api_lists_and_accepts_only_the_members_that_serve():
    from orchestrator.serve.api_schema import _model, models_list

    family = drafted_family()
    assert [m["id"] for m in models_list(family, 0)["data"]] == ["drafted", "m", "l"]
    assert _model({"model": "m"}, family) == ("m", "m")
    with pytest.raises(ModelNotFoundError, match="only drafts for the larger members"):
        _model({"model": "d"}, family)


def test_separate_deployments_have_no_server_of_the_drafter():
    from eval.baseline.static_split import proportional_split

    family = drafted_family()
    assert set(proportional_split(family)) == {"m", "l"}
    assert abs(sum(proportional_split(family).values()) - 1.0) < 1e-12
    # the host tier's per-deployment parts: the drafter's pages (the deployments' draft copies) in the largest's
    lineages = host_tier_lineages(family)
    assert set(lineages) == {"m", "l"}
    assert set(family.member("d").layer_lineages) <= set(lineages["l"])


def test_a_simulated_family_with_a_drafter_drafts_with_it_and_deploys_only_what_serves(tmp_path):
    """Llama-3.1 8B/70B with Llama-3.2 1B drafting (step tables shipped): the 1B drafts for both, serves nothing,
    takes no GPU among the per-member deployments, and each speculating deployment holds its own copy."""
    from eval.simulate.setup import pooled_setups
    from orchestrator.serve.cli import main

    family, separate = pooled_setups("llama3.1-draft1b", "h200_sxm", "trtllm", 6, None)
    assert family.family.serving_names == ["llama3.1-8b", "llama3.1-70b"]
    assert family.member_homes == [("llama3.1-8b",), ("llama3.1-70b",), ("llama3.1-70b",)]
    assert set(separate.split) == {"llama3.1-8b", "llama3.1-70b"}
    # the drafter runs on its targets' GPUs at the widest deployment's TP, in both placements
    assert separate.cost.table.member("llama3.2-1b").tp == 2 == family.cost.table.member("llama3.2-1b").tp
    out = tmp_path / "drafted.json"
    assert main(["simulate", "--family", "llama3.1-draft1b", "--gpu", "h200_sxm", "--placement", "pooled:6",
                 "--sessions", "8", "--rates", "2", "--systems", "mfs,baseline,baseline_spec", "--no-progress",
                 "--no-quality", "--out", str(out)]) == 0
    systems = json.loads(out.read_text())["curve"][0]["systems"]
    for name in ("mfs", "baseline", "baseline_spec"):
        assert set(systems[name]["requests_by_member"]) <= {"llama3.1-8b", "llama3.1-70b"}
        assert systems[name]["num_failed"] == 0
    for name in ("mfs", "baseline_spec"):
        drafted = systems[name]["counters"]["drafted_tokens"]
        assert set(drafted) == {"llama3.2-1b->llama3.1-8b", "llama3.2-1b->llama3.1-70b"}
        assert sum(drafted.values()) > 0
    assert not any(systems["baseline"]["counters"].get("drafted_tokens", {}).values())
    # escalation pairs are among the members that serve: the drafter is never escalated from
    assert set(systems["mfs"]["counters"]["escalations"]) == {"llama3.1-8b->llama3.1-70b"}


def tiny_with_drafter(directory):
    """The shipped tiny family with tiny-s marked drafts_only (family.yaml; checkpoints linked); the manifest text."""
    from orchestrator.core.family import SHIPPED_FAMILIES_DIR

    shipped = SHIPPED_FAMILIES_DIR / "tiny"
    for member in ("tiny-s", "tiny-m", "tiny-l"):
        (directory / member).symlink_to(shipped / member)
    manifest = (shipped / "family.yaml").read_text()
    (directory / "family.yaml").write_text(manifest.replace("    checkpoint: tiny-s\n",
                                                            "    checkpoint: tiny-s\n    drafts_only: true\n"))
    return manifest


def test_family_yaml_marks_the_drafter(tmp_path):
    """`drafts_only: true` on the smallest member in family.yaml; on any other member it is refused by name."""
    from orchestrator.core.family import load_family

    manifest = tiny_with_drafter(tmp_path)
    family = load_family(tmp_path)
    assert family.member("tiny-s").drafts_only and family.serving_names == ["tiny-m", "tiny-l"]
    (tmp_path / "family.yaml").write_text(manifest.replace("    checkpoint: tiny-m\n",
                                                           "    checkpoint: tiny-m\n    drafts_only: true\n"))
    with pytest.raises(FamilyError, match="tiny-m: only the smallest member"):
        load_family(tmp_path)


def test_deployments_sharing_the_familys_gpus_get_the_drafters_memory_back(tmp_path):
    """Co-located: MFS holds the 1B's weights; the separate deployments hold no server of it, so their KV memory is
    MFS's plus the 1B's weights, less one copy per speculating deployment."""
    from orchestrator.serve.cli import main

    out = tmp_path / "colocated.json"
    assert main(["simulate", "--family", "llama3.1-draft1b", "--gpu", "h200_sxm", "--sessions", "4", "--rates", "2",
                 "--systems", "mfs,baseline,baseline_spec", "--baseline-split", "proportional", "--no-progress",
                 "--no-quality", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    pages = {n: c["pool"]["num_pages"] for n, c in result["settings"]["configs"].items()}
    weights = result["simulated"]["memory"]["weights_gib"]
    page_bytes = result["settings"]["configs"]["mfs"]["pool"]["page_bytes"]
    drafter = int(weights["llama3.2-1b"] * 2**30 * 0.9) // page_bytes
    assert pages["baseline"] - pages["mfs"] == pytest.approx(drafter, rel=0.01)
    assert pages["baseline"] - pages["baseline_spec"] == pytest.approx(2 * drafter, rel=0.01)


def test_the_local_engine_serves_with_a_drafter_that_takes_no_request(tmp_path):
    """Real core and local engine (tiny family, CPU): a request the plain family routes to tiny-s goes to tiny-m,
    drafted for by tiny-s; its greedy tokens are tiny-m's without speculation, and every page comes back."""
    import itertools

    from orchestrator.core.config import load_config
    from orchestrator.core.engine_core import EngineCore, drain
    from orchestrator.serve.local_engine import local_executor_factory
    from orchestrator.serve.tokenizer import family_estimator

    tiny_with_drafter(tmp_path)

    def serve(family: str, speculate: bool, complexity: float) -> tuple[list[int], EngineCore]:
        config = load_config(overrides={"family": family, "pool.num_pages": 512, "pool.host_tier_mb": 0,
                                        "escalation.enabled": False, "speculation.enabled": speculate,
                                        "speculation.fixed_k": 3})
        ticks = itertools.count()
        core = EngineCore(config, clock=lambda: float(next(ticks)) * 1e-3, estimator=family_estimator,
                          make_executor=local_executor_factory(config))
        core.scheduler.speculation.use_step_cost(None)          # the fixed k: every verify path runs
        tokens: list[int] = []
        core.add_request(Request(request_id=RequestId("r"), prompt_token_ids=[5, 17, 42, 99, 7, 311, 12, 64],
                                 sampling=SamplingParams(max_tokens=24, ignore_eos=True), arrival_s=0.0,
                                 complexity_hint=complexity), lambda out: tokens.extend(out.new_token_ids))
        drain(core, 500)
        return tokens, core

    plain, _ = serve("tiny", False, 0.5)                          # tiny-m, no speculation
    drafted, core = serve(str(tmp_path), True, 0.1)                # the plain family's tiny-s band
    assert drafted == plain and len(plain) == 24
    counters = core.snapshot()["counters"]
    assert counters["drafted_tokens"]["tiny-s->tiny-m"] > 0
    assert core.pool.num_used_pages() == 0


def test_the_triton_path_refuses_a_drafter_it_could_not_use(tmp_path):
    """Triton's engines do not speculate here: a drafts_only member would hold GPU memory and do nothing."""
    from orchestrator.core.config import load_config
    from orchestrator.core.family import load_family
    from orchestrator.serve.triton_serving import TritonServing

    tiny_with_drafter(tmp_path)
    config = load_config(overrides={"family": str(tmp_path), "engine.kind": "triton"})
    with pytest.raises(FamilyError, match="tiny-s is drafts_only, but the Triton engine path does not speculate"):
        TritonServing(config, family=load_family(tmp_path), url="127.0.0.1:1")
