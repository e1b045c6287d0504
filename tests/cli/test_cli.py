"""trainguard/cli/ as a user runs it: `trainguard serve` says where the console is and whether
auth is on; a client command piped into a reader that stops early (`| head -1`) ends quietly; every
operator command of the registry is a verb whose options are its body's fields, sets the desired
state the controller then shows, and a bad value exits 2 with the model's message, nothing sent."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Literal

import httpx
import pytest
from pydantic import Field

from trainguard import cli
from trainguard.protocol.base import Int
from trainguard.protocol.commands import BY_NAME, REGISTRY, Change, CommandRequest, CommandSpec
from trainguard.service.server import startup_banner

TRAINGUARD = Path(sys.executable).with_name("trainguard")


def _env(**extra: str) -> dict[str, str]:
    return {**{k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}, **extra}


class Serve:
    """`trainguard serve --port 0` as a process; ``lines``: its banner (up to the auth line)."""

    def __init__(self, db: Path, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen([str(TRAINGUARD), "serve", "--port", "0", "--db", str(db), "--log-level", "warning"],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        self.lines: list[str] = []
        while not self.lines or "auth is" not in self.lines[-1]:
            line = self.proc.stdout.readline()
            if not line:
                self.proc.kill()
                raise AssertionError("trainguard serve exited: " + "".join(self.lines))
            self.lines.append(line.rstrip("\n"))
        self.url = self.lines[0].split("listening on ")[1].split()[0]

    def close(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()


@pytest.fixture()
def served(tmp_path):  # type: ignore[no-untyped-def]
    started: list[Serve] = []

    def start(**env: str) -> Serve:
        started.append(Serve(tmp_path / f"tg{len(started)}.db", _env(**env)))
        return started[-1]

    yield start
    for s in started:
        s.close()


def test_serve_without_tokens_names_the_console_and_warns_that_auth_is_off(served, tmp_path) -> None:
    s = served()
    assert s.url.startswith("http://127.0.0.1:") and s.lines[0] == f"trainguard controller listening on {s.url} (db {tmp_path / 'tg0.db'})"
    assert s.lines[1:3] == [f"  console:  {s.url}/ui", f"  API docs: {s.url}/docs"]
    assert s.lines[3].startswith("  WARNING: auth is OFF: no tokens are configured (TRAINGUARD_OPERATOR_TOKENS, TRAINGUARD_AGENT_TOKENS)")
    assert len(s.lines) == 4
    # the URLs it printed are the ones that answer
    with httpx.Client(timeout=10) as c:
        assert c.get(s.lines[1].split()[-1]).status_code == 200
        assert c.get(s.lines[2].split()[-1]).status_code == 200


def test_serve_with_tokens_says_auth_is_on(served) -> None:
    s = served(TRAINGUARD_OPERATOR_TOKENS="operator-token-1,reader-token-22:read", TRAINGUARD_AGENT_TOKENS="agent-token-1")
    assert s.lines[3] == ("  auth is ON: 2 operator and 1 agent token(s) configured; every /v1 request and the "
                          "console need one")
    assert not any("WARNING" in line for line in s.lines)
    with httpx.Client(base_url=s.url, timeout=10) as c:
        assert c.get("/v1/runs").status_code == 401  # what the banner said
        assert c.get("/v1/runs", headers={"Authorization": "Bearer reader-token-22"}).status_code == 200


@pytest.mark.parametrize("host, shown, browse", [("0.0.0.0", "0.0.0.0", "127.0.0.1"), ("::", "[::]", "[::1]"),
                                                 ("10.1.2.3", "10.1.2.3", "10.1.2.3")])
def test_banner_of_an_all_interfaces_bind_names_a_browsable_url(host, shown, browse) -> None:
    settings = SimpleNamespace(db=Path("/data/trainguard.db"), auth_enabled=True, operator_tokens=("a" * 8,), agent_tokens=())
    lines = startup_banner(settings, host, 8000).splitlines()
    assert lines[:3] == [f"trainguard controller listening on http://{shown}:8000 (db /data/trainguard.db)",
                         f"  console:  http://{browse}:8000/ui", f"  API docs: http://{browse}:8000/docs"]
    assert lines[3].startswith("  auth is ON: 1 operator and 0 agent token(s)")


@pytest.mark.skipif(shutil.which("head") is None, reason="needs head(1)")
@pytest.mark.parametrize("command", [["runs", "--json"], ["status", "run-0007"]])
def test_output_piped_into_head_ends_quietly(served, command) -> None:
    """`trainguard ... | head -1` through a real pipe: head exits after one line while the command
    still has output to write; the command prints no traceback and exits with 141, as a tool
    ended by SIGPIPE does. Its output is larger than a pipe's buffer, so head is gone before the
    command has written it all, every time."""
    s = served()
    with httpx.Client(base_url=s.url, timeout=30) as c:
        for i in range(600):  # ~200 KB of `runs --json`
            r = c.post("/v1/runs", json={"job": "job-pipe", "run": f"run-{i:04d}", "world_size": 1, "ranks": []})
            assert r.status_code == 200, r.text
        if command[0] == "status":  # a run whose status is large: many reported series
            values = {f"trainguard_custom_series_{k:04d}_{'x' * 98}": float(k) for k in range(1000)}  # (names of 128 characters)
            r = c.post("/v1/runs/run-0007/reports", json={"job": "job-pipe", "step_first": 1, "step_last": 1,
                                                          "time": 1.0, "values": values})
            assert r.status_code == 200, r.text
    full = subprocess.run([str(TRAINGUARD), *command, "--url", s.url], capture_output=True, timeout=60, env=_env())
    assert full.returncode == 0 and len(full.stdout) > 2 * 64 * 1024, len(full.stdout)  # > 2 pipe buffers
    writer = subprocess.Popen([str(TRAINGUARD), *command, "--url", s.url], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, env=_env())
    reader = subprocess.Popen(["head", "-1"], stdin=writer.stdout, stdout=subprocess.PIPE)
    writer.stdout.close()  # only head holds the pipe's read end now
    first, _ = reader.communicate(timeout=60)
    err = writer.stderr.read()
    writer.stderr.close()
    assert writer.wait(60) == 141, err
    assert err == b""  # no BrokenPipeError traceback, no "Exception ignored"
    assert first == full.stdout.splitlines(keepends=True)[0]


# -- the run commands: one verb per operator command of the registry ------------------------------
def _cli(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(TRAINGUARD), *args, "--url", url], capture_output=True, text=True, timeout=60, env=_env())


def _desired(c: httpx.Client, run: str) -> dict[str, Any]:
    resp = c.get(f"/v1/runs/{run}")
    assert resp.status_code == 200, resp.text
    return resp.json()["desired"]


def test_every_operator_command_of_the_registry_is_a_verb_with_its_fields_as_options() -> None:
    parser = cli._parser()
    verbs = {a.dest: a for a in parser._actions if isinstance(a, argparse._SubParsersAction)}["cmd"].choices
    operator = [spec for spec in REGISTRY if spec.operator]
    assert {"grad-clip", "reset-optimizer", "momentum", "weight-decay-scale", "rollback", "verify", "memory-trace",
            "accumulation"} <= {spec.url for spec in operator}
    for spec in operator:
        options = {o for a in verbs[spec.url]._actions for o in a.option_strings}
        fields = [f for f in spec.request.model_fields if f != "reason"]
        # a list field (reset_optimizer's layers) is given once per item, in the singular
        expected = {"--" + (f[:-1] if f == "layers" else f).replace("_", "-") for f in fields}
        assert expected | {"--reason", "--idempotency-key"} <= options, spec.name
    assert not {spec.url for spec in REGISTRY if not spec.operator} & set(verbs)  # data_skip: the ladder's only
    accumulation = {a.dest: a for a in verbs["accumulation"]._actions}
    assert accumulation["lr_rule"].choices == ("none", "sqrt", "linear")  # the Literal's values


def test_the_new_commands_from_the_cli_set_the_desired_state_the_controller_shows(served) -> None:
    s = served()
    with httpx.Client(base_url=s.url, timeout=30) as c:
        assert c.post("/v1/runs", json={"job": "job-cli", "run": "run-cli", "world_size": 1, "ranks": []}).status_code == 200
        steps = [
            (["grad-clip", "run-cli", "--max-norm", "2.5"], {"grad_clip_norm": 2.5}),
            (["momentum", "run-cli", "0.9"], {"momentum_scale": 0.9}),  # the first field after RUN
            (["momentum", "run-cli", "--factor", "0.5"], {"momentum_scale": 0.45}),
            (["weight-decay-scale", "run-cli", "--scale", "4"], {"weight_decay_scale": 4.0}),
            (["weight-decay-scale", "run-cli", "--factor", "0.25"], {"weight_decay_scale": 1.0}),
            (["reset-optimizer", "run-cli", "--layer", "blocks.3.", "--layer", "head"],
             {"reset_optimizer_seq": 1, "reset_optimizer_layers": "blocks.3.,head"}),
            (["reset-optimizer", "run-cli"], {"reset_optimizer_seq": 2, "reset_optimizer_layers": ""}),  # every layer
            (["lr-scale", "run-cli", "0.5"], {"lr_scale": 0.5}),  # the spelling the docs use
            (["lr-scale", "run-cli", "--factor", "0.5"], {"lr_scale": 0.25}),
            (["grad-clip", "run-cli", "0"], {"grad_clip_norm": 0.0}),  # 0 ends the clipping
        ]
        generation = _desired(c, "run-cli")["generation"]
        for argv, want in steps:
            out = _cli(s.url, *argv, "--reason", "from the cli test")
            assert out.returncode == 0, (argv, out.stderr)
            assert json.loads(out.stdout)["changed"] is True, argv
            desired = _desired(c, "run-cli")
            generation += 1
            assert {k: desired[k] for k in want} == want and desired["generation"] == generation, argv
            assert desired["reason"].startswith("from the cli test")  # and the fold's note, if any
        events = c.get("/v1/runs/run-cli/events").json()
        assert [ev["data"]["command"] for ev in events if ev["kind"] == "desired"] == [
            "grad_clip", "momentum", "momentum", "weight_decay_scale", "weight_decay_scale", "reset_optimizer",
            "reset_optimizer", "lr_scale", "lr_scale", "grad_clip"]


def test_accumulation_keeps_its_positional_steps_and_lr_rule_option(served) -> None:
    s = served()
    with httpx.Client(base_url=s.url, timeout=30) as c:
        body = {"job": "job-cli", "run": "run-acc", "world_size": 1, "ranks": [], "config": {"accumulation_steps": 2}}
        assert c.post("/v1/runs", json=body).status_code == 200
        out = _cli(s.url, "accumulation", "run-acc", "8", "--lr-rule", "linear")
        assert out.returncode == 0, out.stderr
        desired = _desired(c, "run-acc")
        assert (desired["accumulation_steps"], desired["accumulation_lr_rule"]) == (8, "linear")
        out = _cli(s.url, "accumulation", "run-acc", "--steps", "4")  # the model's default rule: sqrt
        assert out.returncode == 0, out.stderr
        desired = _desired(c, "run-acc")
        assert (desired["accumulation_steps"], desired["accumulation_lr_rule"]) == (4, "sqrt")


#: (argv, what the CLI says): each refused before anything is sent.
_BAD = [
    (["grad-clip", "run-bad", "--max-norm", "-1"], "trainguard grad-clip: max_norm: Input should be greater than or equal to 0"),
    (["grad-clip", "run-bad", "--max-norm", "nan"], "trainguard grad-clip: max_norm: Input should be a finite number"),
    (["grad-clip", "run-bad"], "trainguard grad-clip: max_norm is required: give it after RUN or as --max-norm"),
    (["momentum", "run-bad", "--scale", "11"], "trainguard momentum: scale: Input should be less than or equal to 10"),
    (["momentum", "run-bad", "--scale", "0.5", "--factor", "2"],
     "trainguard momentum: give exactly one of 'scale' (absolute) or 'factor' (times the current one)"),
    (["weight-decay-scale", "run-bad"],
     "trainguard weight-decay-scale: give exactly one of 'scale' (absolute) or 'factor' (times the current one)"),
    (["reset-optimizer", "run-bad", "--layer", "a,b"],
     "trainguard reset-optimizer: a layer name prefix is 1-256 characters without commas or control characters, got 'a,b'"),
    (["lr-scale", "run-bad", "0.5", "--scale", "0.25"], "trainguard lr-scale: give scale once: after RUN or as --scale"),
    (["accumulation", "run-bad", "0"], "trainguard accumulation: steps: Input should be greater than or equal to 1"),
]


def test_a_bad_value_exits_2_with_the_models_message_and_sends_nothing(served) -> None:
    s = served()
    with httpx.Client(base_url=s.url, timeout=30) as c:
        assert c.post("/v1/runs", json={"job": "job-cli", "run": "run-bad", "world_size": 1, "ranks": []}).status_code == 200
        for argv, message in _BAD:
            out = _cli(s.url, *argv)
            assert (out.returncode, out.stderr.strip(), out.stdout) == (2, message, ""), argv
        assert _desired(c, "run-bad")["generation"] == 0
        assert [ev["kind"] for ev in c.get("/v1/runs/run-bad/events").json()] == ["registered"]


def test_a_refused_command_exits_1_with_the_controllers_reason(served) -> None:
    s = served()
    with httpx.Client(base_url=s.url, timeout=30) as c:
        assert c.post("/v1/runs", json={"job": "job-cli", "run": "run-ref", "world_size": 1, "ranks": []}).status_code == 200
        out = _cli(s.url, "rollback", "run-ref")  # no snapshot: 409 with the reason
        assert out.returncode == 1 and out.stderr.startswith("error: HTTP 409: ") and "rollback refused" in out.stderr
        assert _desired(c, "run-ref")["generation"] == 0


def test_a_command_to_a_finished_run_is_refused_unless_queued_with_on_restart(served) -> None:
    s = served()
    with httpx.Client(base_url=s.url, timeout=30) as c:
        assert c.post("/v1/runs", json={"job": "job-cli", "run": "run-fin", "world_size": 1, "ranks": []}).status_code == 200
        assert c.post("/v1/runs/run-fin/finish", json={"step": 9, "reason": "end"}).status_code == 200
        out = _cli(s.url, "lr-scale", "run-fin", "0.5")
        assert out.returncode == 1 and out.stderr.startswith('error: HTTP 409: {"detail": "run \'run-fin\' finished at step 9 (end); ')
        assert "--on-restart" in out.stderr and _desired(c, "run-fin")["generation"] == 0
        out = _cli(s.url, "lr-scale", "run-fin", "0.5", "--on-restart")
        assert out.returncode == 0, out.stderr
        assert (json.loads(out.stdout)["applies"], _desired(c, "run-fin")["lr_scale"]) == ("when_registered_again", 0.5)
        assert out.stderr == "trainguard lr-scale: run run-fin finished: this applies when a job registers it again\n"


def test_delete_removes_a_run_from_the_listing_and_refuses_a_live_one_without_force(served) -> None:
    s = served()
    with httpx.Client(base_url=s.url, timeout=30) as c:
        for run in ("run-done", "run-live"):
            assert c.post("/v1/runs", json={"job": "job-cli", "run": run, "world_size": 1, "ranks": []}).status_code == 200
        assert c.post("/v1/runs/run-done/finish", json={"step": 9, "reason": "end"}).status_code == 200
        out = _cli(s.url, "delete", "run-done", "--reason", "debugging run")
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout) == {"run": "run-done", "job": "job-cli", "status": "finished", "deleted": True}
        listed = _cli(s.url, "runs")
        assert [line.split()[0] for line in listed.stdout.splitlines()] == ["RUN", "run-live"]
        deleted = c.get("/v1/runs/run-done/events").json()[-1]
        assert (deleted["kind"], deleted["reason"]) == ("deleted", "debugging run")
        out = _cli(s.url, "delete", "run-live")
        assert out.returncode == 1 and out.stderr.startswith("error: HTTP 409: ") and "run 'run-live' is live: " in out.stderr
        assert _cli(s.url, "delete", "run-live", "--force").returncode == 0
        assert c.get("/v1/runs").json() == []


class _TiltRequest(CommandRequest):
    level: Int = Field(ge=1, le=5, description="How far.")
    mode: Literal["a", "b"] = "a"
    tags: list[str] = Field(default_factory=list)


def test_a_command_added_to_the_registry_is_a_verb_without_editing_the_cli(monkeypatch, capsys) -> None:
    spec = CommandSpec("tilt", "Tilt the run", lambda d, p, ctx: Change(), request=_TiltRequest)
    monkeypatch.setattr(cli, "REGISTRY", (*REGISTRY, spec))
    monkeypatch.setitem(BY_NAME, "tilt", spec)
    closed = "http://127.0.0.1:9"  # nothing listens: a command that got as far as sending exits 1
    args = cli._parser().parse_args(["tilt", "run-x", "--level", "3", "--mode", "b", "--tag", "x", "--tag", "y"])
    assert (args.command, args.run, args.level, args.mode, args.tags) == ("tilt", "run-x", 3, "b", ["x", "y"])
    assert cli.main(["tilt", "run-x", "--level", "9", "--url", closed]) == 2
    assert capsys.readouterr().err.strip() == "trainguard tilt: level: Input should be less than or equal to 5"
    assert cli.main(["tilt", "run-x", "4", "--url", closed]) == 1  # valid: sent (and the controller is not there)
    assert "cannot reach the controller" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        cli.main(["tilt", "run-x", "2", "--mode", "c"])
    assert exit_.value.code == 2 and "invalid choice: 'c'" in capsys.readouterr().err


def test_a_run_name_that_would_be_another_path_is_refused_before_anything_is_sent(served) -> None:
    """``checkpoint other/../run-1`` checkpointed run-1 (the URL's path was normalised); a name
    with a control character or a query ended in a traceback or printed null."""
    s = served()
    with httpx.Client(base_url=s.url, timeout=30) as c:
        assert c.post("/v1/runs", json={"job": "job-cli", "run": "run-1", "world_size": 1, "ranks": []}).status_code == 200
        for argv in (["checkpoint", "other-run/../run-1"], ["status", "../runs"], ["status", ""], ["incidents", "?"],
                     ["pause", "a\tb"], ["events", "run-1/x"], ["alerts", "--run", "a b"]):
            out = _cli(s.url, *argv)
            assert out.returncode == 2 and "not a run name" in out.stderr and "Traceback" not in out.stderr, argv
        assert _desired(c, "run-1")["generation"] == 0
        follow = subprocess.run([str(TRAINGUARD), "events", "no-such-run", "--follow", "--url", s.url], capture_output=True,
                                text=True, timeout=30, env=_env())
        assert follow.returncode == 1 and "HTTP 404" in follow.stderr  # at once, not a stream that never speaks


def test_urls_tokens_durations_and_files_the_cli_cannot_use_are_one_line_errors(tmp_path, capsys) -> None:
    for argv, message in ((["runs", "--url", "http://[::1"], "is not a URL"),
                          (["runs", "--url", "http://127.0.0.1:abc"], "is not a URL"),
                          (["runs", "--url", "http://127.0.0.1:9", "--token", "tök€n"], "--token must be ASCII text")):
        assert cli.main(argv) == 1, argv
        assert message in capsys.readouterr().err
    for ttl in ("inf", "1e308d", "0", "-1h", "nan"):
        with pytest.raises(argparse.ArgumentTypeError, match="positive and finite"):
            cli.parse_ttl(ttl)
    bad = tmp_path / "rules.yaml"
    bad.write_bytes(b"\xff\xfe rules: []")
    assert cli.main(["rules", "check", str(bad)]) == 1
    assert "can't decode" in capsys.readouterr().err
    down = cli.main(["serve", "--db", "postgresql://x@127.0.0.1:1/db", "--port", "0"])
    assert down == 2 and capsys.readouterr().err.startswith("trainguard serve: ")


def test_a_redirect_is_an_error_not_an_empty_answer() -> None:
    from trainguard.cli.client import checked

    with pytest.raises(SystemExit, match="HTTP 301: redirected to 'https://tg.example/v1/runs'"):
        checked(httpx.Response(301, headers={"location": "https://tg.example/v1/runs"}))
    assert checked(httpx.Response(200, json=[1])) == [1]


def test_events_print_control_characters_escaped() -> None:
    from trainguard.cli.reads import _fmt_event

    line = _fmt_event({"id": 7, "time": 0.0, "run": "run-1", "kind": "command", "actor": "op\x1b[2J",
                       "generation": 3, "reason": "evil\x1b[31mRED\rOVER\x00"})
    assert "\x1b" not in line and "\r" not in line and "\x00" not in line
    assert line.endswith("op\\x1b[2J gen=3: evil\\x1b[31mRED\\rOVER\\x00")


@pytest.mark.parametrize(("argv", "missing", "extra"), [
    (["serve", "--port", "0"], "fastapi", "service"),
    # the demo trains and starts a controller: both extras at once, before anything starts
    (["demo", "--steps", "1"], "torch", "agent,service"),
    (["demo", "--steps", "1"], "fastapi", "agent,service"),
    (["demo", "--steps", "1"], "uvicorn", "agent,service"),
    # PyYAML comes with the service extra too, but the dashboards need their own
    (["dashboards", "build", "--check"], "yaml", "dashboards"),
    (["rules", "check", "rules.yaml"], "yaml", "service"),
])
def test_a_command_whose_extra_is_not_installed_names_the_extra(tmp_path, argv, missing, extra) -> None:
    """An environment without the extra a command needs (``pip install 'trainguard[postgres]'``
    then ``trainguard serve``): a sentence naming the extras the command needs, not a traceback."""
    code = (f"import sys; sys.modules[{missing!r}] = None; from trainguard.cli import main; "
            f"sys.exit(main({argv!r}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                         env=_env(PYTHONPATH=os.pathsep.join(sys.path)))
    assert out.returncode == 2, out.stderr
    assert out.stderr == (f"trainguard: this command needs {missing!r}, which this environment lacks: "
                          f"pip install 'trainguard[{extra}]'\n")
