"""The console in a real browser (Debian's Chromium, headless) against a real controller process:
a reporting run appears, its charts draw the window's points and follow new reports, an alert
appears with its diagnosis and its incident (onset, rungs, outcome) without a reload, a real
pre-flight's checks appear on the run's page (and a run without one says so), a pause confirmed in the page is applied by the real
agent and the page shows the step, the page offers every operator command of the registry and a
value typed into an action's field reaches the controller's desired state (a refused one shows the
controller's message), a read-only token gets no actions and is refused, and nothing leaves 127.0.0.1."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import trainer_agent as ta
from tests.control.procs import ROOT, until
from tests.ui.conftest import OPERATOR, READER, Controller, Page, ScriptedAgent, agent_token
from trainguard.protocol.commands import REGISTRY
from trainguard.service.config import Settings

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

#: Reports whose per-rank values the controller keeps: the rank charts draw that many per rank.
RANK_WINDOW = Settings.model_fields["rank_window_reports"].default

# Chart points are read from the data-points attribute each chart keeps (finite points drawn, all
# series together) and checked against the canvas's pixels in the series colour.
_COUNT_SERIES_PIXELS = """(sel) => {
  const c = document.querySelector(sel + ' canvas');
  const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
  let n = 0;
  for (let i = 0; i < d.length; i += 4)
    if (Math.abs(d[i] - 37) < 40 && Math.abs(d[i + 1] - 99) < 40 && Math.abs(d[i + 2] - 235) < 40 && d[i + 3] > 128) n++;
  return n;
}"""


def _values(step: int) -> dict[str, float]:
    return {"trainguard_loss": 3.0 / (1.0 + 0.1 * step), "trainguard_grad_norm": 1.0 + 0.05 * step,
            "trainguard_grad_norm_max": 1.2 + 0.05 * step, "trainguard_update_ratio": 1e-3, "trainguard_lr_scale": 1.0,
            "trainguard_step_duration_seconds": 0.1, "trainguard_tokens_per_second": 5000.0}


def _ranks(step: int) -> dict[str, list[float]]:
    return {"step_time_s": [0.1, 0.1 + 0.001 * step], "grad_norm": [1.0, 1.1], "loss": [1.0, 1.0]}


def _reporting(controller: Controller, run: str, steps: int) -> ScriptedAgent:
    """A scripted agent of ``run`` (rank 0 on node gpu-a, rank 1 registered without its node) that
    has sent the reports of steps 1..``steps``."""
    agent = ScriptedAgent(controller.url, run, nodes=["gpu-a", None])
    for step in range(1, steps + 1):
        agent.report(step, _values(step), _ranks(step))
    return agent


def _wait_points(page: Page, chart: str, condition: str) -> None:
    """Wait until the chart exists and its point count meets ``condition`` (e.g. ">= 20")."""
    page.page.wait_for_function(f"() => {{ const e = document.querySelector('[data-chart=\"{chart}\"]'); return !!e && +e.dataset.points {condition}; }}")


def _points(page: Page, chart: str) -> int:
    return int(page.page.get_attribute(f'[data-chart="{chart}"]', "data-points") or -1)


def test_a_reporting_run_appears_and_its_charts_draw_and_follow_new_reports(page: Page, controller: Controller) -> None:
    agent = _reporting(controller, "run-charts", 12)
    page.sign_in(OPERATOR)
    row = page.page.wait_for_selector('tr[data-run="run-charts"]')
    assert "running" in row.inner_text() and "12" in row.inner_text()
    agent.report(13, _values(13), _ranks(13))  # the runs page follows without a reload
    page.page.wait_for_function("() => document.querySelector('tr[data-run=\"run-charts\"] td:nth-child(4)')?.textContent === '13'")

    page.page.click('tr[data-run="run-charts"] a')
    page.page.wait_for_selector('[data-chart="loss"][data-points="13"]')
    page.page.evaluate("() => { window.notReloaded = true; }")
    run = controller.run("run-charts")
    assert run["reports"] == 13
    assert _points(page, "grad_norm") == 2 * 13  # two series, every report carries both
    assert _points(page, "rank_step_time") == 2 * RANK_WINDOW  # two ranks over the rank window
    assert _points(page, "data_kl") == 0  # not reported: nothing drawn
    assert page.page.evaluate(_COUNT_SERIES_PIXELS, '[data-chart="loss"]') > 100  # the line is on the canvas
    assert page.page.evaluate(_COUNT_SERIES_PIXELS, '[data-chart="data_kl"]') == 0

    for step in range(14, 17):
        agent.report(step, _values(step), _ranks(step))
    page.page.wait_for_selector('[data-chart="loss"][data-points="16"]')
    assert page.page.evaluate("() => window.notReloaded === true")
    page.page.wait_for_function("() => document.querySelector('#run-step')?.textContent === '16'")
    # the per-rank table: each rank's node, and its step time over the median of the other ranks
    page.page.wait_for_selector("#rank-table caption:text('At step 16')")
    cells = page.page.evaluate("() => [...document.querySelectorAll('#rank-table tbody tr')].map((tr) => "
                               "[...tr.children].map((td) => td.textContent))")
    assert [(row[0], row[1], row[-1]) for row in cells] == [("rank 0", "gpu-a", f"{0.1 / 0.116:.4g}×"),
                                                            ("rank 1", "–", f"{0.116 / 0.1:.4g}×")]
    agent.close()


def test_an_alert_appears_with_its_diagnosis_without_a_reload(page: Page, controller: Controller) -> None:
    agent = _reporting(controller, "run-alert", 3)
    page.sign_in(READER, "/ui/runs/run-alert")
    page.page.wait_for_selector('[data-chart="loss"][data-points="3"]')
    assert page.page.query_selector("#firing [data-rule]") is None
    assert page.page.inner_text("#incidents h2") == "Incidents (0)"
    page.page.evaluate("() => { window.notReloaded = true; }")

    agent.report(4, _values(4) | {"trainguard_loss": math.nan}, _ranks(4))
    card = page.page.wait_for_selector("#firing article[data-rule]")
    alerts = controller.operator.get("/v1/alerts", params={"run": "run-alert"}).json()
    assert len(alerts) == 1
    alert = alerts[0]
    assert card.get_attribute("data-rule") == alert["rule"] and card.get_attribute("data-alert-id") == str(alert["id"])
    text = card.inner_text()
    diagnosis = alert["diagnosis"]
    for line in [alert["summary"], diagnosis["symptom"], *diagnosis["likely_causes"], *diagnosis["suggested_actions"]]:
        assert line in text, line
    assert "seed" not in text.lower() and "source document" not in text.lower()
    page.page.wait_for_selector('[data-chart="loss"][data-nonfinite="1"][data-points="3"]')  # the NaN is marked, not dropped
    page.page.wait_for_selector('#run-events tr[data-kind="alert"]')
    # the rule's refused rollback (no snapshot) paused the run: its incident, escalated, appears too
    card = page.page.wait_for_selector('#incident-list article[data-outcome="escalated"]')
    (incident,) = controller.operator.get("/v1/runs/run-alert/incidents").json()["incidents"]
    assert card.get_attribute("data-incident-id") == str(incident["id"]) and incident["onset_step"] == 4
    rungs = card.query_selector_all("ol.rungs li")
    assert [(li.get_attribute("data-rung"), li.get_attribute("data-step")) for li in rungs] == [
        (r["rung"], str(r["step"])) for r in incident["rungs"]] == [("pause", "4")]
    assert incident["rungs"][0]["reason"] in rungs[0].inner_text() and "escalated to a human" in card.inner_text()
    verdict = card.query_selector(".verdict")  # the cause, decided before the first action, and its evidence
    assert verdict.get_attribute("data-cause") == incident["cause"] and incident["verdict"]["summary"] in verdict.inner_text()
    assert [(li.get_attribute("data-signal"), li.get_attribute("data-points-to")) for li in verdict.query_selector_all("li")] == [
        (e["signal"], e["points_to"]) for e in incident["verdict"]["evidence"]] != []
    page.page.wait_for_selector('#run-events tr[data-kind="incident"]')
    assert page.page.evaluate("() => window.notReloaded === true")
    agent.close()


def _preflight_with_exploding_gradients() -> Any:
    """A real pre-flight (``agent.preflight`` on a real model and batch, no controller) whose loss
    is scaled 1e6: its gradient values are far above 1e3."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    agent = ta.attach(model, opt, job="job-ui", run="pf", config=ta.AgentConfig(metrics_port=None))
    try:
        return agent.preflight(torch.randn(4, 8), loss_fn=lambda m, b: m(b).square().mean() * 1e6, clip_grad_norm=1.0)
    finally:
        agent.close()


def test_the_run_page_shows_its_pre_flight_checks_and_says_when_there_are_none(page: Page, controller: Controller) -> None:
    from trainer_agent.diagnostics.preflight import to_wire

    agent = _reporting(controller, "run-preflight", 2)
    page.sign_in(READER, "/ui/runs/run-preflight")
    none = page.page.wait_for_selector("#preflight-none")
    assert "nothing was checked before it trained: gradient values below 1e3" in none.inner_text()
    page.page.evaluate("() => { window.notReloaded = true; }")

    report = _preflight_with_exploding_gradients()
    resp = agent.http.post("/v1/runs/run-preflight/preflight", json=to_wire(report, 0).model_dump(mode="json"))
    assert resp.status_code == 200, resp.text
    page.page.wait_for_selector('#preflight-checks tr[data-check="grad_values"][data-status="fail"]')
    kept = controller.run("run-preflight")["preflight"]
    shown = page.page.evaluate("() => [...document.querySelectorAll('#preflight-checks tbody tr')].map((tr) => "
                               "[tr.dataset.check, tr.dataset.status, tr.children[2].textContent])")
    assert shown == [[c.name, c.status, c.detail] for c in report.checks] == [
        [c["name"], c["status"], c["detail"]] for c in kept["checks"]]
    fails, warns = (sum(c.status == s for c in report.checks) for s in ("fail", "warn"))
    assert page.page.inner_text("#preflight h2") == f"Pre-flight checks ({fails} failed, {warns} warned)"
    assert page.page.query_selector("#preflight-none") is None
    assert page.page.evaluate("() => window.notReloaded === true")
    agent.close()


def test_incident_evidence_shows_its_numbers_as_the_page_shows_numbers(page: Page, controller: Controller) -> None:
    # the wire's non-finite strings, alone or in a rank -> value map, unquoted like every number of the page
    page.sign_in(OPERATOR)
    shown = page.page.evaluate("""async () => {
      const { evidenceText } = await import("/ui/static/run.js");
      return [evidenceText("NaN"), evidenceText("-Infinity"), evidenceText({ 3: "Infinity", 5: 0.25 }),
              evidenceText(["loss_nonfinite"]), evidenceText(0.001234567), evidenceText(null)];
    }""")
    assert shown == ["NaN", "-Infinity", '{"3": Infinity, "5": 0.25}', '["loss_nonfinite"]', "0.001235", "null"]


class _Training:
    """A real agent on a small model, trained in a thread until told to stop: the step counter of
    the loop is kept apart from the agent's, to check the step the page shows."""

    def __init__(self, url: str, run: str) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.05)
        self.agent = ta.attach(self.model, self.opt, job="job-ui", run=run, controller=url, token=agent_token(run),
                               config=ta.AgentConfig(report_every=1, metrics_port=None))
        self.entered = 0  # end_step calls begun
        self.returned = 0  # end_step calls finished
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        g = torch.Generator().manual_seed(1)
        while not self.stop.is_set() and not self.agent.should_stop:
            x = torch.randn(32, 8, generator=g)
            loss = ((self.model(x) - x.sum(dim=1, keepdim=True)) ** 2).mean()
            self.opt.zero_grad()
            loss.backward()
            self.opt.step()
            self.entered += 1
            self.agent.end_step(loss, tokens=32)
            self.returned += 1

    def close(self) -> None:
        self.stop.set()
        self.agent.close()
        self.thread.join(30)
        assert not self.thread.is_alive()


def test_pause_confirmed_in_the_page_holds_the_training_loop_at_the_step_the_page_shows(page: Page, controller: Controller) -> None:
    training = _Training(controller.url, "run-pause")
    try:
        assert until(lambda: not training.thread.is_alive() or (controller.operator.get("/v1/runs/run-pause").status_code == 200
                     and (controller.run("run-pause")["reports"] or 0) >= 20), 60.0)
        assert training.thread.is_alive()
        page.sign_in(OPERATOR, "/ui/runs/run-pause")
        _wait_points(page, "loss", ">= 20")
        _wait_points(page, "update_ratio", ">= 20")

        page.page.click('[data-action="pause"]')
        dialog = page.page.wait_for_selector("dialog#confirm[open]")
        assert "run-pause" in page.page.inner_text("#confirm-title")
        changes = [r.inner_text().split("\t") for r in page.page.query_selector_all("#confirm-changes tr")]
        generation = controller.run("run-pause")["desired_generation"]
        assert changes == [["paused", "false", "true"], ["generation", str(generation), str(generation + 1)]]
        page.page.fill("#confirm-reason", "checking the loss")
        page.page.click("#confirm-ok")
        assert not dialog.is_visible()
        result = page.page.wait_for_selector('#action-result[data-state="applied"]', timeout=60_000)
        step = int(result.get_attribute("data-step"))

        # the training loop is held inside the end_step call of that step, on every rank (one here)
        assert until(lambda: training.entered == step and training.returned == step - 1, 30.0), (step, training.entered)
        run = controller.run("run-pause")
        assert run["desired"]["paused"] and run["desired"]["reason"] == "checking the loss"
        assert run["applied_generation"] == generation + 1 and run["applied_step"] == step
        assert result.inner_text() == f"pause applied at step {step} on every rank (generation {generation + 1})."
        page.page.wait_for_selector('.run-head [data-status="paused"]')
        assert page.page.inner_text("#run-paused") == "yes"
        assert page.page.query_selector('[data-action="resume"]') is not None
    finally:
        controller.operator.post("/v1/runs/run-pause/resume", json={"reason": "test over"})
        training.close()


def _confirm(page: Page, action: str) -> Any:
    """Press an action, confirm it, and wait for every rank's acknowledgement; the result line."""
    page.page.click(f'[data-action="{action}"]')
    page.page.wait_for_selector("dialog#confirm[open]")
    page.page.click("#confirm-ok")
    return page.page.wait_for_selector(f'#action-result[data-state="applied"]:text-matches("^{action} applied")', timeout=60_000)


def test_pause_and_stop_from_the_page_are_applied_by_every_rank_of_a_two_rank_job_at_the_step_shown(
    page: Page, controller: Controller, tmp_path: Path,
) -> None:
    cfg = {"controller": controller.url, "token": agent_token("run-ranks"), "run": "run-ranks", "out": str(tmp_path),
           "max_steps": 100_000, "sleep_s": 0.01}
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")} | {
        "WORLD_SIZE": "2", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    logs = [(tmp_path / f"rank{r}.log").open("w") for r in range(2)]
    ranks = [subprocess.Popen([sys.executable, str(Path(__file__).with_name("console_worker.py")), json.dumps(cfg)],
                              env=env | {"RANK": str(r)}, stdout=logs[r], stderr=subprocess.STDOUT) for r in range(2)]
    try:
        assert until(lambda: any(p.poll() is not None for p in ranks) or (
            controller.operator.get("/v1/runs/run-ranks").status_code == 200 and controller.run("run-ranks")["reports"] >= 60), 120.0)
        assert all(p.poll() is None for p in ranks), [(tmp_path / f"rank{r}.log").read_text()[-2000:] for r in range(2)]
        page.sign_in(OPERATOR, "/ui/runs/run-ranks")
        _wait_points(page, "rank_step_time", f"=== {2 * RANK_WINDOW}")
        shots = [tmp_path / "console-healthy.png", tmp_path / "console-paused.png"]
        page.page.screenshot(path=str(shots[0]), full_page=True)

        paused = int(_confirm(page, "pause").get_attribute("data-step"))
        page.page.wait_for_selector('.run-head [data-status="paused"]')
        page.page.screenshot(path=str(shots[1]), full_page=True)
        if os.environ.get("TRAINGUARD_CONSOLE_SCREENSHOTS"):  # e.g. =docs, to refresh the README's pictures
            for shot in shots:
                shutil.copy(shot, Path(os.environ["TRAINGUARD_CONSOLE_SCREENSHOTS"]) / shot.name)
        stopped = int(_confirm(page, "stop").get_attribute("data-step"))
        assert [p.wait(60) for p in ranks] == [0, 0]
    finally:
        for p in ranks:
            if p.poll() is None:
                p.kill()
                p.wait()
        for f in logs:
            f.close()
    # each rank's own record of what it applied: the pause at the step the page showed, on both
    # ranks, and the stop at that same step (the ranks were waiting there)
    run = controller.run("run-ranks")
    pause_gen, stop_gen = run["desired_generation"] - 1, run["desired_generation"]
    for r in range(2):
        history = json.loads((tmp_path / f"console-rank{r}.json").read_text())["history"]
        by_gen = {h["generation"]: h for h in history}
        assert by_gen[pause_gen]["paused"] and by_gen[pause_gen]["step"] == paused, (r, history)
        assert by_gen[stop_gen]["stop"] and by_gen[stop_gen]["step"] == stopped == paused, (r, history)


def _open_action(page: Page, action: str, fields: dict[str, str]) -> Any:
    """Press an action, type ``fields`` into its dialog and wait for the controller's preview of them."""
    page.page.click(f'#actions [data-action="{action}"]')
    dialog = page.page.wait_for_selector(f'dialog#confirm[open][data-command="{action}"]')
    for name, value in fields.items():
        page.page.fill(f"#confirm-field-{name}", value)
    return dialog


def test_the_page_offers_every_operator_command_and_sends_the_values_typed(page: Page, controller: Controller) -> None:
    agent = _reporting(controller, "run-actions", 3)
    page.sign_in(OPERATOR, "/ui/runs/run-actions")
    page.page.wait_for_selector('#actions [data-action="grad-clip"]')
    offered = [b.get_attribute("data-action") for b in page.page.query_selector_all("#actions [data-action]")]
    assert offered == [s.url for s in REGISTRY if s.operator and s.console and s.kind == "control"] + [
        s.url for s in REGISTRY if s.operator and s.console and s.kind == "diagnostic"]
    assert {"rollback", "verify", "memory-trace", "accumulation", "grad-clip", "reset-optimizer", "momentum",
            "weight-decay-scale"} <= set(offered)
    assert page.page.query_selector("#confirm-field-max_norm") is None  # built when its dialog opens
    assert page.page.inner_text("#alerts").splitlines()[-1] == "None: every rule is quiet."  # and nothing after it

    # grad-clip: a number input with the model's bounds; the preview shows the change, the controller gets the value
    generation = controller.run("run-actions")["desired_generation"]
    _open_action(page, "grad-clip", {"max_norm": "2.5"})
    assert (page.page.get_attribute("#confirm-field-max_norm", "min"), page.page.get_attribute("#confirm-field-max_norm", "max")) == ("0", "1000000")
    page.page.wait_for_selector('#confirm-changes tr[data-field="grad_clip_norm"]')
    changes = [r.inner_text().split("\t") for r in page.page.query_selector_all("#confirm-changes tr")]
    assert changes == [["grad_clip_norm", "0", "2.5"], ["generation", str(generation), str(generation + 1)]]
    page.page.fill("#confirm-reason", "clip from the page")
    page.page.click("#confirm-ok")
    page.page.wait_for_selector(f'#action-result[data-state="pending"]:text-is("grad-clip sent as generation {generation + 1}; '
                                'waiting for every rank to apply it…")')
    desired = controller.run("run-actions")["desired"]
    assert desired["grad_clip_norm"] == 2.5 and desired["reason"].startswith("clip from the page")
    page.page.click("#desired-state summary")  # the page shows the controller's new state
    page.page.wait_for_selector('#desired-grad_clip_norm:text-is("2.5")')

    # reset-optimizer: a list typed comma-separated, a dangerous action's confirmation
    _open_action(page, "reset-optimizer", {"layers": "blocks.0., head"})
    assert page.page.get_attribute("#confirm-ok", "class") == "danger"
    page.page.wait_for_selector('#confirm-changes tr[data-field="reset_optimizer_seq"]')
    assert "This cannot be undone" in page.page.inner_text("#confirm-body")
    page.page.click("#confirm-ok")
    page.page.wait_for_selector('#action-result[data-state="pending"]:text-matches("^reset-optimizer sent")')
    desired = controller.run("run-actions")["desired"]
    assert (desired["reset_optimizer_seq"], desired["reset_optimizer_layers"]) == (1, "blocks.0.,head")

    # momentum with both a scale and a factor: the model refuses it (422) and the page says why
    before = controller.run("run-actions")["desired"]
    _open_action(page, "momentum", {"scale": "0.5", "factor": "2"})
    message = "give exactly one of 'scale' (absolute) or 'factor' (times the current one)"
    page.page.wait_for_selector(f'#confirm-note[data-state="error"]:text-is("{message} (HTTP 422)")')
    page.page.click("#confirm-ok")
    page.page.wait_for_selector(f'#action-result[data-state="error"]:text-is("momentum refused: {message} (HTTP 422)")')
    # a rollback without a snapshot: refused by the controller (409) with its reason
    _open_action(page, "rollback", {})
    page.page.wait_for_selector('#confirm-note[data-state="error"]:text-matches("^rollback refused: ")')
    page.page.click("#confirm-ok")
    result = page.page.wait_for_selector('#action-result[data-state="error"]:text-matches("^rollback refused: rollback refused: ")')
    assert result.inner_text().endswith("(HTTP 409)")
    assert controller.run("run-actions")["desired"] == before
    agent.close()


def test_a_finished_run_refuses_an_action_until_it_is_queued_for_the_runs_restart(page: Page, controller: Controller) -> None:
    agent = _reporting(controller, "run-finished", 3)
    assert agent.http.post("/v1/runs/run-finished/finish", json={"step": 3, "reason": "done"}).status_code == 200
    page.sign_in(OPERATOR, "/ui/runs/run-finished")
    page.page.wait_for_selector('#actions [data-action="pause"]')
    before = controller.run("run-finished")["desired"]
    _open_action(page, "pause", {})
    page.page.wait_for_selector('#confirm-note[data-state="error"]:text-matches("^run .run-finished. finished at step 3 .done.; its ranks are gone")')
    page.page.check("#confirm-field-on_restart")
    page.page.wait_for_selector('#confirm-note:text-matches("^The run finished: this applies when a job registers run '
                                'run-finished again")')
    page.page.click("#confirm-ok")
    page.page.wait_for_selector(f'#action-result[data-state="queued"]:text-is("pause queued as generation '
                                f'{before["generation"] + 1}: the run finished; it applies when a job registers run '
                                'run-finished again.")')
    desired = controller.run("run-finished")["desired"]
    assert (desired["paused"], desired["generation"]) == (True, before["generation"] + 1)
    agent.close()


def test_a_read_only_token_sees_no_action_buttons_and_its_requests_are_refused(page: Page, controller: Controller) -> None:
    agent = _reporting(controller, "run-readonly", 3)
    page.sign_in(READER, "/ui/runs/run-readonly")
    page.page.wait_for_selector('[data-chart="loss"][data-points="3"]')
    assert page.page.query_selector_all("[data-action]") == []
    assert not page.page.is_visible("#actions")
    statuses = page.page.evaluate("""async () => {
      const { csrf } = await (await fetch('/ui/api/session')).json();
      const out = [];
      for (const [cmd, body] of [['pause', {}], ['stop', {}], ['lr-scale', {scale: 0.5}], ['checkpoint', {}]]) {
        const r = await fetch('/ui/api/runs/run-readonly/' + cmd, {method: 'POST', headers: {'Content-Type': 'application/json', 'X-CSRF-Token': csrf}, body: JSON.stringify(body)});
        out.push(r.status);
      }
      return out;
    }""")
    assert statuses == [403, 403, 403, 403]
    assert controller.run("run-readonly")["desired_generation"] == 0
    agent.close()


def test_the_console_works_with_no_network_but_loopback(page: Page, controller: Controller) -> None:
    agent = _reporting(controller, "run-offline", 5)
    page.sign_in(OPERATOR)
    page.page.wait_for_selector('tr[data-run="run-offline"]')
    page.page.click('tr[data-run="run-offline"] a')
    page.page.wait_for_selector('[data-chart="loss"][data-points="5"]')
    page.page.click('nav a[data-nav="audit"]')
    page.page.wait_for_selector('#audit tr[data-kind="registered"]')
    page.page.goto(controller.url + "/docs")
    assert "trainguard controller" in page.page.wait_for_selector(".swagger-ui .info .title").inner_text()  # Swagger UI rendered the API
    assert page.requests and page.refused == [], page.refused
    assert all(url.startswith(controller.url + "/") for url in page.requests), page.requests
    # the tokens never travel in a URL nor land in the controller's log (the access log is on)
    log = controller.log.read_text()
    assert "/ui/login" in log
    for token in (OPERATOR, READER):
        assert not any(token in url for url in page.requests) and token not in log
    agent.close()
