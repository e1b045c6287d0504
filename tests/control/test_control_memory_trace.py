"""Memory localisation end to end, against a real controller process: a loop that keeps every loss
with its graph makes the ``memory_growth`` rule fire; its ``memory_trace`` action makes the agent
trace a few steps; the result (the loop's kept graphs on top) is stored with the run and shown on
the firing alert. An operator's ``trainguard memory-trace`` starts another trace the same way."""

from __future__ import annotations

import gc

import httpx
import torch
import yaml
from torch import nn

import trainer_agent as ta
from tests.control.procs import ControllerProcess, until
from trainer_agent.diagnostics.memory_trace import GRAPH
from trainguard.cli import main as cli


def _fast_memory_rule(url: str) -> None:
    """The default rules, with memory_growth judged over 6 reports (a test cannot wait for 32) by
    the slope of the values rather than by their never decreasing: on this machine the
    never-decreasing condition cleared during the two traced steps (before the trace's result
    arrived; the code before and after the command registry alike), and the test is about that
    result reaching the alert."""
    doc = yaml.safe_load(httpx.get(f"{url}/v1/rules", timeout=10).json()["text"])
    (rule,) = [r for r in doc["rules"] if r["name"] == "memory_growth"]
    assert rule["actions"] == ["notify", "memory_trace"]  # the default action under test
    rule.update(window=6, direction="not_decreasing", min_rel_change=0.0)
    httpx.put(f"{url}/v1/rules", content=yaml.safe_dump(doc), timeout=10).raise_for_status()


def test_memory_growth_starts_a_trace_whose_result_reaches_the_run_and_its_alert(tmp_path) -> None:
    ctl = ControllerProcess(tmp_path / "tg.db").start()
    try:
        _fast_memory_rule(ctl.url)
        torch.manual_seed(0)
        width = 1024
        model = nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 1))
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        agent = ta.attach(model, opt, job="leaky", run="leaky-1",
                          config=ta.AgentConfig(controller=ctl.url, metrics_port=None, report_every=1,
                                                memory_trace_steps=2))
        kept: list[torch.Tensor] = []

        def step(leak: bool) -> None:
            loss = model(torch.randn(256, width)).square().mean()
            loss.backward(retain_graph=leak)
            opt.step()
            opt.zero_grad()
            if leak:
                kept.append(loss)  # the stability guide's example: the loss kept with its whole graph
            agent.end_step(loss.detach())

        def stored() -> dict | None:
            detail = ctl.run_detail("leaky-1")
            return detail["memory_report"] if detail else None

        # The gauge on the CPU is the process's resident set: garbage of the tests before, freed
        # by a collection inside the window, once made it fall (the slope negative, the alert
        # resolved before the trace's result came); collected here, and each step keeps ~3 MiB.
        gc.collect()
        for _ in range(400):  # bounded: the rule fires after a few reports of growth
            step(leak=True)
            if agent.memory_report is not None:
                break
        assert agent.memory_report is not None, "the memory_growth rule never started a trace"
        assert until(lambda: stored() is not None, 30)
        detail = ctl.run_detail("leaky-1")
        report = detail["memory_report"]
        assert report["owners"][0]["owner"] == GRAPH and report["owners"][0]["bytes_per_step"] > 256 * width * 4
        assert report["steps"] == 2 and report["device"] == "cpu"
        assert detail["desired"]["memory_trace_seq"] == 1
        (alert,) = [a for a in detail["firing_alerts"] if a["rule"] == "memory_growth"]
        assert alert["memory_report"]["owners"] == report["owners"]
        events = httpx.get(f"{ctl.url}/v1/runs/leaky-1/events", timeout=10).json()
        asked = [e for e in events if e["kind"] == "desired" and e["data"]["desired"]["memory_trace_seq"] == 1]
        assert asked and asked[0]["actor"].startswith("rule")
        first_step = report["step"]

        # an operator's command: the loop no longer leaks, and the new trace says so
        kept.clear()
        assert cli(["memory-trace", "leaky-1", "--url", ctl.url, "--reason", "after the fix"]) == 0
        for _ in range(400):
            step(leak=False)
            if (s := stored()) is not None and s["step"] > first_step:
                break
        again = stored()
        assert again["step"] > first_step
        assert all(o["owner"] != GRAPH for o in again["owners"])
        assert ctl.run_detail("leaky-1")["desired"]["memory_trace_seq"] == 2
        agent.close()
    finally:
        ctl.kill()
