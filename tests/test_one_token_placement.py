"""A request whose whole answer is its first token (max_tokens 1) has nothing to decode: it may
run whole on a worker that only prefills, so that no KV moves and the decode workers' steps are
left to their decodes. Placement with injected measurements: no workers, no clock."""

from __future__ import annotations

from router.candidates import answering
from router.policy import Policy
from router.vocab import RoutePath
from tests.cost_fixtures import planner, shape, trained, with_decodes


def _where(decision) -> tuple[RoutePath, str, str]:
    c = decision.chosen
    return c.path, c.prefill_worker, c.decode_worker


def test_only_a_request_of_one_token_may_run_whole_on_a_prefill_worker():
    p, both = trained("prefill-0", "prefill", seed=3), trained("both-0", "both", seed=5)
    d = trained("decode-0", "decode", seed=4)
    one, two = shape(200, max_tokens=1), shape(200, max_tokens=2)
    assert [w.worker_id for w in answering(one, [p, both], [d, both])] == [
        "prefill-0", "decode-0", "both-0"
    ]  # fmt: skip
    assert [w.worker_id for w in answering(two, [p, both], [d, both])] == ["decode-0", "both-0"]
    cands = planner().candidates(one, [p], [d])
    assert {(c.path, c.prefill_worker, c.decode_worker) for c in cands} == {
        (RoutePath.COLOCATED, "", "decode-0"),
        (RoutePath.COLOCATED, "", "prefill-0"),
        (RoutePath.DISAGGREGATED, "prefill-0", "decode-0"),  # never a handoff to prefill-0
    }
    assert all(c.decode_worker != "prefill-0" for c in planner().candidates(two, [p], [d]))


def test_auto_answers_a_one_token_request_on_the_prefill_worker_not_beside_decodes():
    """Beside 12 running decodes whose ITL SLO its prefill would push, or on an idle decode
    worker alike, a request of one token runs on the idle prefill worker: no transfer, and no
    decode's step slowed. One that decodes stays off it."""
    p = trained("prefill-0", "prefill", seed=3)
    busy = with_decodes(trained("decode-0", "decode", seed=4), 12, 512, 0.08)
    for d in (busy, trained("decode-0", "decode", seed=4)):
        decision = planner().decide(shape(300, max_tokens=1), [p], [d])
        assert _where(decision) == (RoutePath.COLOCATED, "", "prefill-0"), decision.reason
    decision = planner().decide(shape(300, max_tokens=2), [p], [busy])
    assert decision.chosen.decode_worker == "decode-0", decision.reason


def test_a_fixed_colocated_path_takes_the_least_loaded_worker_able_to_answer():
    """--policy colocated, a client's path, or prompt logprobs (computed where the prompt is):
    a request of one token goes to the least loaded of the decode and prefill workers; one that
    decodes goes to a decode worker. --policy disaggregated and the threshold hand it off as
    before (the fixed policies the bench compares)."""
    p = trained("prefill-0", "prefill", seed=3)
    d = with_decodes(trained("decode-0", "decode", seed=4), 8, 512, 1.0)
    one, two = shape(300, max_tokens=1), shape(300, max_tokens=2)
    pl = planner(Policy.COLOCATED)
    assert _where(pl.decide(one, [p], [d])) == (RoutePath.COLOCATED, "", "prefill-0")
    assert _where(pl.decide(two, [p], [d])) == (RoutePath.COLOCATED, "", "decode-0")
    for why in ("override", "prompt_logprobs"):
        asked = planner().decide(one, [p], [d], RoutePath.COLOCATED, why=why)
        assert _where(asked) == (RoutePath.COLOCATED, "", "prefill-0")
    # Idle alike: the prefill worker, leaving the decode worker to the decodes to come.
    idle = trained("decode-0", "decode", seed=4)
    assert _where(pl.decide(one, [p], [idle])) == (RoutePath.COLOCATED, "", "prefill-0")
    for policy in (Policy.DISAGGREGATED, Policy.THRESHOLD):
        pl = planner(policy, threshold_tokens=10)
        assert _where(pl.decide(one, [p], [d])) == (
            RoutePath.DISAGGREGATED, "prefill-0", "decode-0"
        )  # fmt: skip


def test_auto_never_hands_off_a_request_of_one_token():
    """A handoff of a request with nothing to decode only adds a transfer to the same prefill:
    auto answers it where it is prefilled, though its prompt takes longer than an ITL SLO to
    prefill (a prefill beside decodes to come, were there any) and the colocated path's first
    tokens have lately come later than predicted (its bias, not the handoffs')."""
    p = trained("prefill-0", "prefill", seed=3)
    d = trained("decode-0", "decode", seed=4)
    req = shape(1500, max_tokens=1, slo_itl=0.05)
    pl = planner()
    assert p.model.prefill_s(1500, 0) > req.slo_itl_s
    decision = pl.decide(req, [p], [d])
    assert _where(decision) == (RoutePath.COLOCATED, "", "prefill-0"), decision.reason
    assert "no handoff: one token, nothing to decode" in decision.reason
    assert "prefill-0->decode-0" in decision.reason
    for _ in range(64):  # colocated first tokens twice as late as predicted
        pl.bias[RoutePath.COLOCATED].observe(1.0, 2.0)
    decision = pl.decide(req, [p], [d])
    assert decision.chosen.path is RoutePath.COLOCATED, decision.reason
    # Two tokens: the handoff stays a candidate auto may take.
    two = pl.decide(shape(1500, max_tokens=2, slo_itl=0.05), [p], [d])
    assert two.chosen.path is RoutePath.DISAGGREGATED, two.reason
