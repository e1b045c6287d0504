"""Deleting a run from the console (service/ui/removal.js, the run page's deletion in run.js, and
``DELETE /ui/api/runs/{run}``) in a real browser (Debian's Chromium, headless) against a real
controller process: a finished run is deleted from its page and leaves another page's run list
without a reload; a live run is refused with the controller's reason, then deleted by force with a
reason; a read-only session sees no Delete button and a forged request is refused; a page open on
a run that another operator deletes says so."""

from __future__ import annotations

import re
from typing import Any

import pytest

from tests.ui.conftest import OPERATOR, READER, Controller, Page, ScriptedAgent

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def _reporting(controller: Controller, run: str, steps: int = 3) -> ScriptedAgent:
    agent = ScriptedAgent(controller.url, run)
    for step in range(1, steps + 1):
        agent.report(step, {"trainguard_loss": 1.0 / step, "trainguard_grad_norm": 1.0})
    return agent


def _registered(controller: Controller, run: str) -> bool:
    status = controller.operator.get(f"/v1/runs/{run}").status_code
    assert status in (200, 404)
    return status == 200


def _deleted_event(controller: Controller, run: str) -> dict[str, Any]:
    ev = controller.operator.get(f"/v1/runs/{run}/events").json()[-1]
    assert ev["kind"] == "deleted"
    return ev


def _open_run(page: Page, token: str, run: str) -> None:
    page.sign_in(token, f"/ui/runs/{run}")
    page.page.wait_for_selector('[data-chart="loss"][data-points="3"]')
    page.page.evaluate("() => { window.notReloaded = true; }")


def _banner(page: Page, run: str, ev: dict[str, Any]) -> str:
    """The page's line on the deletion, once it says who deleted the run and why."""
    text = page.page.wait_for_selector(f'#run-deleted:has-text("{ev["reason"]}")').inner_text()
    assert text.startswith(f"Run {run} was deleted by {ev['actor']} (") and f"): {ev['reason']}." in text
    page.page.wait_for_selector('.run-head [data-status="deleted"]')
    assert not page.page.is_visible("#delete-run") and page.page.query_selector_all("#actions [data-action]") == []
    assert page.page.evaluate("() => window.notReloaded === true")
    return text


def _confirm_deletion(page: Page, controller: Controller, run: str, reason: str, data: dict[str, Any]) -> None:
    """Type ``reason`` into the open confirmation and confirm: the run is deleted with that reason
    and ``data`` (its status, whether forced), and the page says so."""
    page.page.fill("#delete-reason", reason)
    page.page.click("#delete-ok")
    page.page.wait_for_selector("#run-deleted:visible")
    assert not _registered(controller, run)
    ev = _deleted_event(controller, run)
    assert (ev["reason"], ev["data"]) == (reason, data)
    _banner(page, run, ev)


def test_a_finished_run_is_deleted_from_its_page_and_leaves_the_run_list_without_a_reload(
    page: Page, browser: Any, controller: Controller,
) -> None:
    run = "run-del-finished"
    agent = _reporting(controller, run)
    assert agent.http.post(f"/v1/runs/{run}/finish", json={"step": 3}).status_code == 200
    agent.close()
    watcher = Page(browser, controller)  # another operator, on the run list
    try:
        watcher.sign_in(READER)
        watcher.page.wait_for_selector(f'tr[data-run="{run}"]')
        watcher.page.evaluate("() => { window.notReloaded = true; }")
        _open_run(page, OPERATOR, run)

        page.page.click("#delete-run")
        page.page.wait_for_selector('dialog#delete-confirm[open][data-force="false"]')
        assert page.page.inner_text("#delete-title") == f"Delete run {run}?"
        assert not page.page.is_visible("#delete-refusal") and page.page.inner_text("#delete-ok") == "Delete"
        _confirm_deletion(page, controller, run, "finished, results copied", {"status": "finished", "forced": False})

        watcher.page.wait_for_selector(f'tr[data-run="{run}"]', state="detached")  # the other page, without a reload
        assert watcher.page.evaluate("() => window.notReloaded === true") and not watcher.errors
        page.page.click('#run-deleted a[href="/ui"]')
        page.page.wait_for_selector("#runs")
        assert page.page.query_selector(f'tr[data-run="{run}"]') is None
        assert page.page.evaluate("() => window.notReloaded === true")
        ev = _deleted_event(controller, run)
        page.page.goto(f"{controller.url}/ui/runs/{run}")  # its address later, e.g. from the audit log
        text = page.page.wait_for_selector("#run-deleted").inner_text()
        assert text.startswith(f"Run {run} was deleted by {ev['actor']} (") and f"): {ev['reason']}." in text
        missing = "run-never-registered"
        page.page.goto(f"{controller.url}/ui/runs/{missing}")
        assert page.page.wait_for_selector("#app p.error").inner_text() == f"run '{missing}' is not registered"
    finally:
        watcher.close()


def _without_seconds(text: str) -> str:
    return re.sub(r"was \d+ s ago", "was N s ago", text)


def test_a_live_run_is_refused_with_the_controllers_reason_then_deleted_by_force_with_a_reason(
    page: Page, controller: Controller,
) -> None:
    run = "run-del-live"
    agent = _reporting(controller, run)
    _open_run(page, OPERATOR, run)
    page.page.click("#delete-run")
    page.page.wait_for_selector('dialog#delete-confirm[open][data-force="false"]')
    page.page.click("#delete-ok")
    refusal = page.page.wait_for_selector('dialog#delete-confirm[open][data-force="true"] #delete-refusal:visible').inner_text()
    assert _registered(controller, run)
    answer = controller.operator.delete(f"/v1/runs/{run}")  # what the API answers the same request
    assert answer.status_code == 409
    assert _without_seconds(refusal) == _without_seconds(f"The controller refused: {answer.json()['detail']}")
    assert "is live: its last report or registration was" in refusal
    assert page.page.inner_text("#delete-title") == f"Delete run {run} anyway?" and page.page.inner_text("#delete-ok") == "Delete anyway"
    assert page.page.inner_text("#action-result").startswith("delete refused: ")

    page.page.click("#delete-ok")  # a forced delete needs a reason: the form is not sent without one
    assert page.page.is_visible("dialog#delete-confirm") and _registered(controller, run)
    _confirm_deletion(page, controller, run, "the job hangs; its agent is gone", {"status": "running", "forced": True})
    agent.close()


def test_a_read_only_session_sees_no_delete_button_and_a_forged_delete_is_refused(page: Page, controller: Controller) -> None:
    run = "run-del-readonly"
    agent = _reporting(controller, run)
    assert agent.http.post(f"/v1/runs/{run}/finish", json={"step": 3}).status_code == 200
    _open_run(page, READER, run)
    assert page.page.query_selector("#delete-run") is None and not page.page.is_visible("#removal")
    statuses = page.page.evaluate("""async (run) => {
      const { csrf } = await (await fetch('/ui/api/session')).json();
      const out = [];
      for (const headers of [{'X-CSRF-Token': csrf}, {}]) {
        const r = await fetch('/ui/api/runs/' + run, {method: 'DELETE', body: JSON.stringify({force: true, reason: 'forged'}),
                                                      headers: {'Content-Type': 'application/json', ...headers}});
        out.push([r.status, (await r.json()).detail]);
      }
      return out;
    }""", run)
    assert statuses == [[403, "this operator token lacks the 'command' scope"], [403, "missing or wrong X-CSRF-Token header"]]
    assert _registered(controller, run)
    agent.close()


def test_a_page_open_on_a_run_another_operator_deletes_says_so_without_a_reload(page: Page, controller: Controller) -> None:
    run = "run-del-elsewhere"
    agent = _reporting(controller, run)
    _open_run(page, OPERATOR, run)
    page.page.wait_for_selector("#delete-run")
    reason = "cleaning up <img src=x onerror=window.injected=1>"  # shown as text, never as markup
    resp = controller.operator.delete(f"/v1/runs/{run}", params={"force": "true", "reason": reason})
    assert resp.status_code == 200
    assert reason in _banner(page, run, _deleted_event(controller, run))
    assert page.page.query_selector("#run-deleted img") is None and page.page.evaluate("() => window.injected === undefined")
    assert page.page.inner_text("#run-step") == "3"  # what the page showed stays
    agent.close()
