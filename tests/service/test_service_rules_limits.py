"""Rules files an attacker or a careless client sends: alias bombs, too many rules, a body without
rules, and a large file that must not hold the event loop (``service/rules.py``,
``service/routes/rules.py``)."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import httpx
import pytest
import yaml

from trainguard.service.app import create_app
from trainguard.service.routes.rules import MAX_EVALUATIONS
from trainguard.service.config import Settings
from trainguard.service.rules import (
    MAX_ACTIONS, MAX_JOBS, MAX_NODES, MAX_OVERRIDES, MAX_RULES, REMOVE_ALL_PARAM, RulesError, default_rules_text, load_rules,
)

OP, RO = "operator-token-1", "readonly-token-1"
TOKENS = dict(operator_tokens=(OP, f"{RO}:read"))
AS_RO = {"Authorization": f"Bearer {RO}"}
AS_OP = {"Authorization": f"Bearer {OP}"}


def _rule(name: str, actions: str = "[notify]") -> str:
    return f"{{name: {name}, kind: threshold, metric: trainguard_loss, op: '>', value: 1, actions: {actions}}}"


def alias_bomb(jobs: int = 1000, overrides: int = 100, actions: int = MAX_ACTIONS) -> str:
    """~12 KB of YAML: one action list, one override using it ``overrides`` times per job, and
    the same list of overrides for ``jobs`` jobs (jobs x overrides x actions once expanded)."""
    acts = "[" + ", ".join(["notify"] * actions) + "]"
    text = f"rules:\n  - {_rule('r', '&A ' + acts)}\n"
    text += "jobs:\n  j0: &L [&P {name: r, value: 2, actions: *A}" + ", *P" * (overrides - 1) + "]\n"
    return text + "".join(f"  j{i}: *L\n" for i in range(1, jobs))


def expanded_nodes(text: str) -> int:
    """The bomb's node count with every alias written out (a reference computation: the
    constructed Python objects, walked as a tree)."""
    def count(v: object) -> int:
        if isinstance(v, dict):
            return 1 + sum(count(k) + count(x) for k, x in v.items())
        if isinstance(v, list):
            return 1 + sum(count(x) for x in v)
        return 1
    return count(yaml.safe_load(text))


def test_an_alias_bomb_is_refused_before_it_is_expanded() -> None:
    small = alias_bomb(jobs=3, overrides=4, actions=2)
    assert expanded_nodes(small) < MAX_NODES
    load_rules(small)  # the same shape within the limit is a valid file
    bomb = alias_bomb()
    assert len(bomb) < 16_000 and expanded_nodes(alias_bomb(jobs=10)) * 100 > MAX_NODES
    with pytest.raises(RulesError) as info:
        load_rules(bomb)
    assert info.value.reasons == [f"the rules file holds more than {MAX_NODES:,} YAML nodes once its aliases are expanded "
                                  "(the limit of a rules file); write the rules out without multiplying aliases"]


def test_an_alias_to_its_own_ancestor_is_refused() -> None:
    with pytest.raises(RulesError, match="YAML nodes once its aliases are expanded"):
        load_rules("rules: &R [{name: a, kind: threshold, metric: trainguard_loss, op: '>', value: 1, actions: *R}]")


def test_an_alias_bomb_sent_to_the_rules_test_is_refused_and_a_read_only_token_may_not_send_it(app_factory) -> None:
    with app_factory(**TOKENS) as c:
        r = c.post("/v1/rules/test", json={"rules": alias_bomb(), "reports": []}, headers=AS_RO)
        assert r.status_code == 403  # testing rules takes the rules scope, as replacing them does
        r = c.post("/v1/rules/test", json={"rules": alias_bomb(), "reports": []}, headers=AS_OP)
        assert r.status_code == 422
        assert r.json()["reasons"][0].startswith(f"the rules file holds more than {MAX_NODES:,} YAML nodes")


def test_a_simulation_beyond_the_evaluation_limit_is_refused_before_it_runs(app_factory) -> None:
    rules = "rules:\n" + "".join(f"  - {_rule(f'r{i}')}\n" for i in range(MAX_RULES))
    reports = MAX_EVALUATIONS // MAX_RULES + 1
    body = {"rules": rules, "reports": [{"job": "test", "step_first": i, "step_last": i, "time": float(i)} for i in range(reports)]}
    with app_factory(**TOKENS) as c:
        r = c.post("/v1/rules/test", json=body, headers=AS_OP)
        assert r.status_code == 422
        assert r.json()["detail"] == (f"{MAX_RULES:,} rules x {reports:,} reports is {MAX_RULES * reports:,} rule evaluations; "
                                      f"a simulation takes at most {MAX_EVALUATIONS:,} (send fewer reports or rules)")
        within = dict(body, reports=body["reports"][:3])
        assert c.post("/v1/rules/test", json=within, headers=AS_OP).status_code == 200


@pytest.mark.parametrize("what, text, reason", [
    ("rules", "rules:\n" + "".join(f"  - {_rule(f'r{i}')}\n" for i in range(MAX_RULES + 1)),
     f"rules: {MAX_RULES + 1:,} rules; a rules file holds at most {MAX_RULES:,}"),
    ("jobs", "rules: [" + _rule("r") + "]\njobs:\n" + "".join(f"  j{i}: [{{name: r, value: 2}}]\n" for i in range(MAX_JOBS + 1)),
     f"jobs: overrides for {MAX_JOBS + 1:,} jobs; a rules file holds at most {MAX_JOBS:,}"),
    ("overrides", "rules: [" + _rule("r") + "]\njobs:\n" + "".join(
        f"  j{i}: [{', '.join(['{name: r, value: 2}'] * 11)}]\n" for i in range(MAX_OVERRIDES // 11 + 1)),
     f"jobs: {11 * (MAX_OVERRIDES // 11 + 1):,} overrides in all; a rules file holds at most {MAX_OVERRIDES:,}"),
])
def test_counts_beyond_the_limits_are_refused_naming_the_limit(what, text, reason) -> None:
    with pytest.raises(RulesError) as info:
        load_rules(text)
    assert info.value.reasons == [reason]


def test_more_actions_than_the_limit_are_refused() -> None:
    load_rules("rules: [" + _rule("r", "[" + ", ".join(["notify"] * MAX_ACTIONS) + "]") + "]")
    with pytest.raises(RulesError) as info:
        load_rules("rules: [" + _rule("r", "[" + ", ".join(["notify"] * (MAX_ACTIONS + 1)) + "]") + "]")
    assert any(f"at most {MAX_ACTIONS} items" in r for r in info.value.reasons), info.value.reasons


def test_put_over_the_rule_cap_is_refused_with_the_limit_and_the_rules_stay(app_factory) -> None:
    text = "rules:\n" + "".join(f"  - {_rule(f'r{i}')}\n" for i in range(MAX_RULES + 1))
    with app_factory(**TOKENS) as c:
        before = c.get("/v1/rules", headers=AS_RO).json()
        r = c.put("/v1/rules", content=text, headers=AS_OP)
        assert r.status_code == 422
        assert r.json()["reasons"] == [f"rules: {MAX_RULES + 1:,} rules; a rules file holds at most {MAX_RULES:,}"]
        assert c.get("/v1/rules", headers=AS_RO).json() == before


def test_duplicate_rule_names_are_each_named_once() -> None:
    names = ["a", "b", "a", "c", "c", "c", "d"]
    with pytest.raises(RulesError) as info:
        load_rules("rules: [" + ", ".join(_rule(n) for n in names) + "]")
    assert info.value.reasons == ["rules: Value error, duplicate rule names: a, c"]
    load_rules("rules: [" + ", ".join(_rule(n) for n in sorted(set(names))) + "]")


# -- a body without rules ------------------------------------------------------------------------
@pytest.mark.parametrize("body", ["", "version: 1\n", "{}", "null", "rules: []\n", '{"rules": []}'])
def test_a_body_without_rules_is_refused_and_the_safety_rules_stay(app_factory, body) -> None:
    with app_factory(**TOKENS) as c:
        before = c.get("/v1/rules", headers=AS_RO).json()
        r = c.put("/v1/rules", content=body, headers=AS_OP)
        assert r.status_code == 422, r.text
        (reason,) = r.json()["reasons"]
        assert "remove every rule, loss_nonfinite" in reason and f"?{REMOVE_ALL_PARAM}=true" in reason
        after = c.get("/v1/rules", headers=AS_RO).json()
        assert after == before and "loss_nonfinite" in [x["name"] for x in after["rules"]["rules"]]


def test_removing_every_rule_takes_an_explicit_empty_list_and_the_confirmation(app_factory, tmp_path) -> None:
    with app_factory(**TOKENS) as c:
        assert c.put("/v1/rules", content="version: 1\n", params={REMOVE_ALL_PARAM: "true"}, headers=AS_OP).status_code == 422
        r = c.put("/v1/rules", content="rules: []\n", params={REMOVE_ALL_PARAM: "true"}, headers=AS_OP)
        assert r.status_code == 200 and r.json()["rules"]["rules"] == [] and r.json()["source"] == "api"
    with app_factory(**TOKENS) as c:  # restarted on the same database: the choice was kept
        assert c.get("/v1/rules", headers=AS_RO).json()["rules"]["rules"] == []


# -- a large file does not hold the event loop -----------------------------------------------------
def test_healthz_is_answered_while_a_large_rules_file_is_validated(tmp_path: Path) -> None:
    """The validation of a large PUT signals when it starts and then waits until /healthz was
    answered: with validation on the event loop /healthz could only be answered after it (the
    wait gives up after 30 s, so the test fails instead of hanging)."""
    text = "rules:\n" + "".join(f"  - {_rule(f'r{i}')}\n" for i in range(MAX_RULES))
    order: list[str] = []
    started, healthz_answered = threading.Event(), threading.Event()

    async def scenario() -> None:
        app = create_app(Settings(db=tmp_path / "tg.db", **TOKENS))
        ctl = app.state.controller
        validate = ctl.rules_store.validate

        def validate_and_wait(body: str):  # type: ignore[no-untyped-def]
            order.append("validation started")
            started.set()
            healthz_answered.wait(30)
            rules = validate(body)
            order.append("validation done")
            return rules

        ctl.rules_store.validate = validate_and_wait
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://controller") as client:
                put = asyncio.create_task(client.put("/v1/rules", content=text, headers=AS_OP))
                await asyncio.to_thread(started.wait, 30)
                health = await client.get("/healthz")
                order.append(f"healthz {health.status_code}")
                healthz_answered.set()
                answer = await put
        assert answer.status_code == 200, answer.text
        assert len(answer.json()["rules"]["rules"]) == MAX_RULES

    asyncio.run(scenario())
    assert order == ["validation started", "healthz 200", "validation done"]


def test_the_default_rules_are_well_within_the_limits() -> None:
    text = default_rules_text()
    assert expanded_nodes(text) * 10 < MAX_NODES and len(load_rules(text).base) * 10 < MAX_RULES


def test_a_simulation_of_more_ranks_than_a_run_may_have_or_of_too_many_rank_values_is_refused(app_factory) -> None:
    """``world_size`` at most the controller's TRAINGUARD_MAX_WORLD_SIZE, and the reports x
    world_size at most ``MAX_RANK_REPORTS``: each refused with the limit named before any rule runs."""
    from trainguard.service.routes.rules import MAX_RANK_REPORTS

    def body(world: int, reports: int) -> dict:
        return {"world_size": world, "reports": [
            {"job": "test", "step_first": i, "step_last": i, "time": float(i), "ranks": {"loss": {"fill": 1.0, "n": world}}}
            for i in range(reports)]}

    with app_factory(max_world_size=64, **TOKENS) as c:
        r = c.post("/v1/rules/test", json=body(65, 1), headers=AS_OP)
        assert r.status_code == 422
        assert r.json()["detail"] == ("world_size 65 exceeds TRAINGUARD_MAX_WORLD_SIZE=64: the controller accepts no run "
                                      "that large")
        assert c.post("/v1/rules/test", json=body(64, 2), headers=AS_OP).status_code == 200
    with app_factory(**TOKENS) as c:
        reports = MAX_RANK_REPORTS // 32_768 + 1
        r = c.post("/v1/rules/test", json=body(32_768, reports), headers=AS_OP)
        assert r.status_code == 422
        assert r.json()["detail"] == (f"{reports} reports x world_size 32,768 is {reports * 32_768:,} rank values; a "
                                      f"simulation takes at most {MAX_RANK_REPORTS:,} (send fewer reports)")
        answer = c.post("/v1/rules/test", json=body(32_768, 3), headers=AS_OP).json()
        assert [s["index"] for s in answer["steps"]] == [0, 1, 2]
