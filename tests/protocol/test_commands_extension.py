"""A command declared once works everywhere: a new command added to the registry the way a
developer adds one (its request, its rule action and its ``CommandSpec`` in
``trainguard/protocol/commands.py``) plus its actuator (``@actuator``) is, with no other edit, a
REST route with its bounds, a CLI verb, a rules-file action, an Alertmanager action, a field of the
stored desired state (kept across a restart), a label of the actions metric, part of the ranks'
agreement, and applied by the agent of a real training run at the step every rank agreed on.

Each check runs in a fresh interpreter whose ``trainguard.protocol.commands`` is the real module's
source with the new declaration added, so nothing here leaks into the other tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import trainguard.protocol.commands as commands

pytestmark = pytest.mark.integration

#: What a developer writes in commands.py for a new command: its body, its rule action, its spec.
DECLARATION = '''
class TiltRequest(CommandRequest):
    """Body of ``POST /v1/runs/{run}/tilt``."""

    degrees: float = Field(strict=True, ge=0, le=90, allow_inf_nan=False, description="How far to tilt.")


class TiltAction(RuleAction):
    type: Literal["tilt"] = "tilt"
    degrees: float = Field(ge=0, le=90, allow_inf_nan=False)
'''
SPEC = '''    CommandSpec(
        "tilt", "Tilt the run by some degrees", lambda d, p, ctx: Change({"tilt_degrees": p.degrees}),
        fields=(_f("tilt_degrees", "float", 0.0, "How far the run is tilted.", ge=0.0, le=90.0),),
        request=TiltRequest, rule_action=TiltAction),
'''

PRELUDE = r'''
import importlib.util, pathlib, sys
path = pathlib.Path(COMMANDS)
src = path.read_text()
assert src.count("\n# -- the registry") == 1 and src.count("\n)\n\nBY_NAME") == 1
src = src.replace("\n# -- the registry", DECLARATION + "\n\n# -- the registry")
src = src.replace("\n)\n\nBY_NAME", "\n" + SPEC + ")\n\nBY_NAME")
module = importlib.util.module_from_spec(importlib.util.spec_from_loader("trainguard.protocol.commands", loader=None))
module.__file__ = str(path)
sys.modules["trainguard.protocol.commands"] = module
exec(compile(src, str(path), "exec"), module.__dict__)
'''

ACTUATOR = r'''
from trainer_agent.control.actuators import Actuator, actuator

applied = []

@actuator("tilt")
class Tilt(Actuator):
    def apply(self, new, old, step):
        if new.tilt_degrees != old.tilt_degrees:
            applied.append((step, new.tilt_degrees))
'''

EVERYWHERE = r'''
import json, threading, time
import httpx, torch, uvicorn
import trainer_agent as ta
from trainguard.cli import main as cli
from trainguard.protocol.commands import STATE_LEN, DesiredState, decode_state, encode_state
from trainguard.service.app import create_app
from trainguard.service.config import Settings

out = {}
out["state_len"] = STATE_LEN
d = DesiredState(generation=1, tilt_degrees=12.5)
out["codec"] = decode_state(encode_state(d)).tilt_degrees

def serve(db):
    server = uvicorn.Server(uvicorn.Config(create_app(Settings(db=db, tick_s=60)), host="127.0.0.1", port=0, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.02)
    return server, f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"

server, url = serve(DB)
c = httpx.Client(base_url=url, timeout=30)
out["route"] = "/v1/runs/{run}/tilt" in c.get("/openapi.json").json()["paths"]
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
agent = ta.attach(model, opt, job="job-x", run="run-x",
                  config=ta.AgentConfig(controller=url, report_every=1, sync_every=1, metrics_port=None))

def step(n):
    loss = model(torch.full((2, 4), float(n))).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    agent.end_step(loss)

for n in range(1, 4):
    step(n)
out["cli"] = [cli(["tilt", "run-x", "12", "--url", url]), c.get("/v1/runs/run-x").json()["desired"]["tilt_degrees"]]
r = c.post("/v1/runs/run-x/tilt", json={"degrees": 100})
out["too_far"] = [r.status_code, r.json()["detail"]]
r = c.post("/v1/runs/run-x/tilt", json={"degrees": 30, "reason": "by hand"})
generation = r.json()["desired"]["generation"]
client = agent.control.client
while client.desired is None or client.desired.generation < generation:
    time.sleep(0.01)
for n in range(4, 8):
    step(n)
out["applied"] = applied
out["history"] = [[a.generation, a.step] for a in agent.control.history]
out["generation"] = generation
alert = {"status": "firing", "labels": {"alertname": "Tilt", "run": "run-x", "trainguard_action": "tilt",
         "trainguard_degrees": "45"}, "annotations": {}, "startsAt": "2026-01-01T00:00:00Z", "fingerprint": "t1"}
payload = {"version": "4", "status": "firing", "receiver": "trainguard", "groupLabels": {}, "commonLabels": {},
           "commonAnnotations": {}, "externalURL": "", "groupKey": "{}", "truncatedAlerts": 0, "alerts": [alert]}
out["alertmanager"] = c.post("/v1/alertmanager", json=payload).json()["results"][0].get("outcome")
out["after_alert"] = c.get("/v1/runs/run-x").json()["desired"]["tilt_degrees"]
rules = c.get("/v1/rules").json()
rules_text = (
    "version: 1\nrules:\n  - name: tilt_on_nan\n    kind: nonfinite\n    metric: trainguard_loss\n"
    "    severity: warning\n    actions: [{type: tilt, degrees: 60}]\n")
put = c.put("/v1/rules", content=rules_text, headers={"content-type": "application/yaml"})
out["rules"] = put.status_code
c.post("/v1/runs/run-x/reports", json={"job": "job-x", "step_first": 100, "step_last": 100, "time": 1.0,
                                      "values": {"trainguard_loss": "NaN"}})
out["after_rule"] = c.get("/v1/runs/run-x").json()["desired"]["tilt_degrees"]
metrics = c.get("/metrics").text
out["counted"] = [line for line in metrics.splitlines() if line.startswith("trainguard_controller_actions_total") and 'action="tilt"' in line]
agent.close(5.0)
server.should_exit = True
time.sleep(1.0)
server, url = serve(DB)  # restarted: the stored desired state holds the new field
out["restarted"] = httpx.get(f"{url}/v1/runs/run-x", timeout=30).json()["desired"]["tilt_degrees"]
server.should_exit = True
print("RESULT " + json.dumps(out))
'''


def _run(tmp_path: Path, *parts: str) -> subprocess.CompletedProcess:
    head = (f"COMMANDS = {commands.__file__!r}\nDECLARATION = {DECLARATION!r}\nSPEC = {SPEC!r}\n"
            f"DB = {str(tmp_path / 'tg.db')!r}\n")
    script = head + "\n".join(textwrap.dedent(p) for p in parts)
    env = dict(os.environ, TRAINGUARD_OPERATOR_TOKENS="", TRAINGUARD_AGENT_TOKENS="")
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env,
                          cwd=Path(__file__).resolve().parents[2])


def test_a_command_without_its_actuator_fails_at_import(tmp_path: Path) -> None:
    proc = _run(tmp_path, PRELUDE, "import trainer_agent.control.plane\n")
    assert proc.returncode != 0
    assert "TypeError" in proc.stderr and "tilt" in proc.stderr.splitlines()[-1], proc.stderr[-2000:]


def test_a_command_declared_once_works_everywhere(tmp_path: Path) -> None:
    proc = _run(tmp_path, PRELUDE, ACTUATOR, EVERYWHERE)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    out = json.loads(lines[0][len("RESULT "):])
    assert out["state_len"] == commands.STATE_LEN + 1 and out["codec"] == 12.5
    assert out["cli"] == [0, 12.0] and out["route"] is True
    assert out["too_far"][0] == 422 and "less than or equal to 90" in json.dumps(out["too_far"][1])
    # applied once, by the agent, at the step at which the ranks agreed on the generation
    applied_at = dict(out["history"])[out["generation"]]
    assert out["applied"] == [[applied_at, 30.0]]
    assert out["alertmanager"] == "applied" and out["after_alert"] == 45.0
    assert out["rules"] == 200 and out["after_rule"] == 60.0
    counted = {line.split('source="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1]) for line in out["counted"]}
    assert {k: v for k, v in counted.items() if v} == {"operator": 2.0, "alertmanager": 1.0, "rule": 1.0}, counted
    assert out["restarted"] == 60.0
