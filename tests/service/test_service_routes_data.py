"""The run's status carries the batch size in use and the one the noise scale recommends; the
per-rank input wait and data overlap vectors are accepted and checked against the world size."""

from __future__ import annotations

from tests.service.conftest import register


def _report(step: int, values: dict, **ranks: list) -> dict:
    return {"job": "job-a", "step_first": step, "step_last": step, "time": 1.0, "values": values, "ranks": ranks}


def test_status_shows_current_and_recommended_batch_size(app_factory) -> None:  # type: ignore[no-untyped-def]
    with app_factory() as c:
        register(c, world_size=2)
        assert c.get("/v1/runs/run-1").json()["batch_size"] == {"current": None, "recommended": None}
        body = _report(5, {"trainguard_global_batch_size": 4096.0, "trainguard_recommended_batch_size": 18000.5},
                       input_wait_s=[0.001, 0.002], data_overlap=[0.0, 0.01])
        assert c.post("/v1/runs/run-1/reports", json=body).status_code == 200
        assert c.get("/v1/runs/run-1").json()["batch_size"] == {"current": 4096.0, "recommended": 18000.5}
        bad = c.post("/v1/runs/run-1/reports", json=_report(6, {}, input_wait_s=[0.1, 0.2, 0.3]))
        assert bad.status_code == 422 and "input_wait_s" in bad.text


def test_accumulation_command_needs_a_run_that_opted_in(app_factory) -> None:  # type: ignore[no-untyped-def]
    with app_factory() as c:
        register(c, run="run-1")
        refused = c.post("/v1/runs/run-1/accumulation", json={"steps": 8})
        assert refused.status_code == 409 and "accumulation_steps" in refused.text
        body = {"job": "job-a", "run": "run-2", "world_size": 1, "config": {"accumulation_steps": 2}}
        assert c.post("/v1/runs", json=body).status_code == 200
        for bad in ({"steps": 0}, {"steps": 8, "lr_rule": "cubic"}, {"steps": 70000}):
            assert c.post("/v1/runs/run-2/accumulation", json=bad).status_code == 422
        ok = c.post("/v1/runs/run-2/accumulation", json={"steps": 8, "lr_rule": "linear", "reason": "noise scale"})
        assert ok.status_code == 200
        desired = ok.json()["desired"]
        assert (desired["accumulation_steps"], desired["accumulation_lr_rule"], desired["generation"]) == (8, "linear", 1)
        # the same again changes nothing; back to the run's own with 0 is not a valid body (steps >= 1)
        assert c.post("/v1/runs/run-2/accumulation", json={"steps": 8, "lr_rule": "linear"}).json()["changed"] is False
        # survives a later lr-scale command (the other fields carry over)
        after = c.post("/v1/runs/run-2/lr-scale", json={"scale": 0.5}).json()["desired"]
        assert (after["accumulation_steps"], after["lr_scale"]) == (8, 0.5)


def test_diagnostic_commands_bump_their_sequence_and_survive_a_restart(app_factory) -> None:  # type: ignore[no-untyped-def]
    with app_factory() as c:
        register(c, world_size=2)
        first = c.post("/v1/runs/run-1/memory-trace", json={"reason": "where does it leak"}).json()["desired"]
        assert (first["memory_trace_seq"], first["verify_seq"], first["generation"]) == (1, 0, 1)
        second = c.post("/v1/runs/run-1/verify", json={}).json()["desired"]
        # every request is new (a counter, like checkpoint): a repeat bumps it again
        third = c.post("/v1/runs/run-1/verify", json={}).json()["desired"]
        assert (second["verify_seq"], third["verify_seq"], third["memory_trace_seq"], third["generation"]) == (1, 2, 1, 3)
        kept = c.post("/v1/runs/run-1/lr-scale", json={"scale": 0.5}).json()["desired"]
        assert (kept["memory_trace_seq"], kept["verify_seq"]) == (1, 2)
    with app_factory() as c:  # the same database
        desired = c.get("/v1/runs/run-1").json()["desired"]
        assert (desired["memory_trace_seq"], desired["verify_seq"], desired["lr_scale"]) == (1, 2, 0.5)


def test_a_memory_report_is_shown_in_the_status_and_recorded(app_factory) -> None:  # type: ignore[no-untyped-def]
    with app_factory() as c:
        register(c, world_size=2)
        body = {"rank": 0, "step": 42, "steps": 3, "device": "cpu",
                "owners": [{"owner": "<training loop: graph kept alive>", "bytes_per_step": 1048576.0, "tensors": 3},
                           {"owner": "blocks.3", "bytes_per_step": 4096.0, "tensors": 1}]}
        assert c.post("/v1/runs/run-1/memory-report", json=body).status_code == 200
        shown = c.get("/v1/runs/run-1").json()["memory_report"]
        assert shown["owners"] == body["owners"] and shown["step"] == 42
        (event,) = [e for e in c.get("/v1/runs/run-1/events").json() if e["kind"] == "memory_report"]
        assert "<training loop: graph kept alive>: 1.00 MiB/step" in event["reason"]
        for bad in ({**body, "owners": [{"owner": "x", "bytes_per_step": -1.0, "tensors": 1}]},
                    {**body, "steps": 0}, {**body, "device": "tpu"}):
            assert c.post("/v1/runs/run-1/memory-report", json=bad).status_code == 422
        assert c.post("/v1/runs/nope/memory-report", json=body).status_code == 404
