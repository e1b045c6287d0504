"""``trainguard``: start the controller, and talk to it.

    trainguard serve --host 127.0.0.1 --port 8000 --db trainguard.db --rules rules.yaml
    trainguard runs
    trainguard status RUN
    trainguard pause RUN --reason "loss spike, investigating"
    trainguard resume RUN | checkpoint RUN | stop RUN | rollback RUN
    trainguard lr-scale RUN 0.5 | lr-scale RUN --factor 0.5
    trainguard accumulation RUN 8 --lr-rule sqrt
    trainguard grad-clip RUN --max-norm 1.0 | momentum RUN --scale 0.9 | weight-decay-scale RUN --factor 2
    trainguard reset-optimizer RUN --layer blocks.3. --layer head
    trainguard incidents RUN
    trainguard events RUN --follow
    trainguard alerts --state firing
    trainguard memory-trace RUN | verify RUN
    trainguard preflight train.py [args...] | trainguard preflight -m package.train [args...]
    trainguard rules check rules.yaml
    trainguard token create --job 'llm-7b*' --scope agent --ttl 30d --name "llm fleet"
    trainguard token list | trainguard token revoke ID

The run commands (pause ... reset-optimizer) are the command registry's
(``trainguard.protocol.commands.REGISTRY``): one verb per operator command, its options the fields
of its request model, the first of them also accepted right after RUN; the body is validated
before it is sent (a bad value exits with status 2 and says why).

Client commands take ``--url`` (env ``TRAINGUARD_URL``, default http://127.0.0.1:8000) and
``--token`` (env ``TRAINGUARD_TOKEN``). ``trainguard demo ...`` and ``trainguard dashboards build
...`` hand their arguments to ``trainguard.demo.run`` and ``dashboards.build``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import signal
import socket
import sys
import uuid
from typing import Any, Sequence

import httpx
from pydantic import ValidationError

from trainguard.protocol.command_inputs import command_inputs, validation_message
from trainguard.protocol.commands import BY_NAME, REGISTRY, CommandSpec

__all__ = ["main"]

_DEFAULT_URL = "http://127.0.0.1:8000"


def _client(args: argparse.Namespace, timeout: float | None = 10.0) -> httpx.Client:
    headers = {"Authorization": f"Bearer {args.token}"} if args.token else {}
    return httpx.Client(base_url=args.url.rstrip("/"), headers=headers, timeout=timeout)


def _check(resp: httpx.Response) -> Any:
    if resp.status_code >= 400:
        try:
            detail = resp.json()
        except ValueError:
            detail = resp.text
        raise SystemExit(f"error: HTTP {resp.status_code}: {json.dumps(detail) if not isinstance(detail, str) else detail}")
    return resp.json() if resp.content else None


def _print(value: Any) -> None:
    print(json.dumps(value, indent=2, sort_keys=False))


# -- serve ------------------------------------------------------------------------------------
def _serve(args: argparse.Namespace) -> int:
    from trainguard.service.app import create_app
    from trainguard.service.config import Settings
    from trainguard.service.rules import RulesError
    from trainguard.service.server import ControllerServer, make_config, startup_banner

    overrides = {k: v for k, v in (("host", args.host), ("port", args.port), ("db", args.db), ("rules", args.rules)) if v is not None}
    try:
        settings = Settings(**overrides)
        app = create_app(settings)
    except ValidationError as e:
        msgs = "; ".join(err["msg"].removeprefix("Value error, ") for err in e.errors())
        print(f"trainguard serve: {msgs}", file=sys.stderr)
        return 2
    except (RulesError, ValueError, OSError) as e:
        print(f"trainguard serve: {e}", file=sys.stderr)
        return 2
    family = socket.AF_INET6 if ":" in settings.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((settings.host, settings.port))
    except OSError as e:
        print(f"trainguard serve: cannot bind {settings.host}:{settings.port}: {e}", file=sys.stderr)
        return 2
    host, port = sock.getsockname()[:2]
    config = make_config(app, settings, log_level=args.log_level, access_log=args.access_log)
    # Listen before saying so: connections made right after the line below wait in the backlog
    # until the app has started, instead of being refused.
    sock.listen(config.backlog)
    print(startup_banner(settings, host, port), flush=True)
    # Everything built so far (modules, the app, the runs and windows read back from the
    # database) lives as long as the process: keep it out of the collector's full passes, which
    # otherwise walk it all (~12 ms with the default rules and 200 runs) every few thousand reports.
    gc.collect()
    gc.freeze()
    ControllerServer(config, app.state.controller).run(sockets=[sock])
    return 0


# -- client commands ----------------------------------------------------------------------------
def _runs(args: argparse.Namespace) -> int:
    with _client(args) as c:
        runs = _check(c.get("/v1/runs", params={"job": args.job} if args.job else None))
    if args.json:
        _print(runs)
        return 0
    print(f"{'RUN':<28} {'JOB':<20} {'STATUS':<10} {'STEP':>9} {'GEN':>4} {'APPLIED':>7}  FIRING")
    for r in runs:
        last = r["finished_step"] if r.get("finished_step") is not None else r["last_step"]  # a finished run: its final step
        step = "" if last is None else last
        print(f"{r['run']:<28} {r['job']:<20} {r['status']:<10} {step:>9} {r['desired_generation']:>4} {r['applied_generation']:>7}  {','.join(r['firing'])}")
    return 0


def _status(args: argparse.Namespace) -> int:
    with _client(args) as c:
        _print(_check(c.get(f"/v1/runs/{args.run}")))
    return 0


def _add_command(sub: Any, client: argparse.ArgumentParser, spec: CommandSpec) -> None:
    """``trainguard <spec.url> RUN [FIRST] [--option ...]``: one option per field of the command's
    body (:func:`trainguard.protocol.command_inputs.command_inputs`); the first field may also be
    given right after RUN (``trainguard lr-scale RUN 0.5``, ``trainguard reset-optimizer RUN a b``)."""
    summary = spec.summary.replace("%", "%%")  # argparse formats help texts with %
    s = sub.add_parser(spec.url, parents=[client], help=summary, description=summary)
    s.add_argument("run")
    inputs = command_inputs(spec.request)
    types = {"number": float, "integer": int, "text": str, "list": str, "choice": str}
    for i, inp in enumerate(inputs):
        notes = inp.notes()
        helptext = (inp.description + (f" ({notes})" if notes else "")).replace("%", "%%")
        if i == 0:
            s.add_argument(f"{inp.name}_first", metavar=inp.metavar, nargs="*" if inp.type == "list" else "?",
                           type=types.get(inp.type, str), help=f"the same as {inp.option}")
        if inp.type == "boolean":
            s.add_argument(inp.option, dest=inp.name, action=argparse.BooleanOptionalAction, default=None, help=helptext)
        else:
            s.add_argument(inp.option, dest=inp.name, type=types[inp.type], choices=inp.choices or None,
                           metavar=None if inp.choices else inp.metavar,
                           action="append" if inp.type == "list" else "store", default=None, help=helptext)
    s.add_argument("--reason", default="", help="why (recorded in the audit log)")
    s.add_argument("--idempotency-key", default=None, help="default: a fresh UUID")
    s.set_defaults(func=_command, command=spec.name)


def _command(args: argparse.Namespace) -> int:
    """Send a registry command, its body validated by the command's request model first (a bad
    value: exit status 2 and the model's message, nothing sent)."""
    spec = BY_NAME[args.command]
    body: dict[str, Any] = {"reason": args.reason or ""}
    for i, inp in enumerate(command_inputs(spec.request)):
        value, first = getattr(args, inp.name), getattr(args, f"{inp.name}_first", None) if i == 0 else None
        if first not in (None, []):
            if value is not None:
                print(f"trainguard {spec.url}: give {inp.name} once: after RUN or as {inp.option}", file=sys.stderr)
                return 2
            value = first
        if value is None and inp.required:
            print(f"trainguard {spec.url}: {inp.name} is required: give it after RUN or as {inp.option}", file=sys.stderr)
            return 2
        if value is not None:
            body[inp.name] = value
    try:
        req = spec.request.model_validate(body)
    except ValidationError as e:
        print(f"trainguard {spec.url}: {validation_message(e)}", file=sys.stderr)
        return 2
    key = args.idempotency_key or str(uuid.uuid4())  # safe to retry this exact request
    with _client(args) as c:
        _print(_check(c.post(f"/v1/runs/{args.run}/{spec.url}", json=req.model_dump(mode="json", exclude_unset=True),
                             headers={"Idempotency-Key": key})))
    return 0


def _incidents(args: argparse.Namespace) -> int:
    with _client(args) as c:
        body = _check(c.get(f"/v1/runs/{args.run}/incidents"))
    if args.json:
        _print(body)
        return 0
    print(format_incidents(body["incidents"]))
    return 0


def format_incidents(incidents: list[dict[str, Any]]) -> str:
    """Incidents as lines of text: onset, each rung (step, by whom, why), outcome."""
    if not incidents:
        return "no incidents"
    lines = []
    for inc in incidents:
        end = "" if inc["closed_step"] is None else f" at step {inc['closed_step']}"
        lines.append(f"incident {inc['id']}: onset step {inc['onset_step']} ({inc['trigger']}) -> {inc['outcome']}{end}")
        lines.extend(format_verdict(inc))
        for r in inc["rungs"]:
            lines.append(f"  step {r['step']:>7}  {r['rung']:<12} {r['actor']}: {r['reason']}")
    return "\n".join(lines)


def format_verdict(inc: dict[str, Any]) -> list[str]:
    """An incident's cause and the evidence it was decided on, as indented lines."""
    verdict = inc.get("verdict") or {}
    lines = [f"  cause: {inc.get('cause', 'unknown')}: {verdict.get('summary', '')}"]
    if verdict.get("ranks"):
        lines.append("  suspect: " + ", ".join(f"rank {r} on {h}" for r, h in zip(verdict["ranks"], verdict.get("hosts", []))))
    for e in verdict.get("evidence", []):
        ref = "" if e.get("reference") is None else f" (against {json.dumps(e['reference'])})"
        lines.append(f"    {e['points_to']:<9} {e['signal']} = {json.dumps(e['value'])}{ref}: {e['detail']}")
    if verdict.get("revised"):
        rev = verdict["revised"]
        lines.append(f"  revised at step {rev['step']} from {rev['from']}: {rev['summary']}")
    exp = inc.get("experiment")
    if exp:
        lines.append(f"  experiment: LR x{exp['lr_factor']:g} for steps {exp['from_step']}-{exp['until_step']}: "
                     f"{exp.get('conclusion') or 'running'}")
    if inc.get("data_skipped"):
        first, last = inc["data_skipped"]
        lines.append(f"  data: the optimizer steps {first}-{last} skipped on every rank (their samples quarantined "
                     "by the run's TokenLoader)")
    return lines


def _fmt_event(ev: dict[str, Any]) -> str:
    from datetime import datetime

    when = datetime.fromtimestamp(ev["time"]).strftime("%Y-%m-%d %H:%M:%S")
    gen = "" if ev.get("generation") is None else f" gen={ev['generation']}"
    return f"{ev['id']:>6} {when} {ev['run']} {ev['kind']:<10} {ev['actor']}{gen}: {ev['reason']}"


def _events(args: argparse.Namespace) -> int:
    with _client(args, timeout=None if args.follow else 10.0) as c:
        if not args.follow:
            for ev in _check(c.get(f"/v1/runs/{args.run}/events", params={"after": args.after})):
                print(json.dumps(ev) if args.json else _fmt_event(ev))
            return 0
        params = {"run": args.run, "after": args.after}
        try:
            with c.stream("GET", "/v1/events/stream", params=params) as resp:
                if resp.status_code >= 400:
                    resp.read()
                    _check(resp)
                for line in resp.iter_lines():
                    if line.startswith("data: "):
                        ev = json.loads(line[6:])
                        print(json.dumps(ev) if args.json else _fmt_event(ev), flush=True)
        except KeyboardInterrupt:
            return 0
    return 0


def _alerts(args: argparse.Namespace) -> int:
    params = {k: v for k, v in (("state", args.state), ("run", args.run)) if v}
    with _client(args) as c:
        alerts = _check(c.get("/v1/alerts", params=params))
    if args.json:
        _print(alerts)
    else:
        for a in alerts:
            print(f"{a['id']:>6} {a['state']:<8} {a['severity']:<8} {a['run']:<24} {a['rule']:<24} {a['summary']}")
    return 0


def _rules_check(args: argparse.Namespace) -> int:
    from trainguard.service.rules import RulesError, load_rules

    try:
        with open(args.file, encoding="utf-8") as f:
            rs = load_rules(f.read(), check_names=True)
    except (OSError, RulesError) as e:
        print(f"{args.file}: {e}", file=sys.stderr)
        return 1
    print(f"{args.file}: {len(rs.base)} rules, overrides for {len(rs.by_job)} job(s): OK")
    return 0


_TTL_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_ttl(text: str) -> float:
    """``30d``, ``12h``, ``90m``, ``3600s`` or plain seconds -> seconds."""
    unit = text[-1:].lower()
    number = text[:-1] if unit in _TTL_UNITS else text
    try:
        value = float(number) * _TTL_UNITS.get(unit, 1)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (e.g. 30d, 12h, 90m, 3600s)") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"a duration must be positive, got {text!r}")
    return value


def _token(args: argparse.Namespace) -> int:
    with _client(args) as c:
        if args.token_cmd == "create":
            body: dict[str, Any] = {"name": args.name, "scopes": args.scope.split("+"), "ttl_s": args.ttl}
            if args.job is not None:
                body["job"] = args.job
            made = _check(c.post("/v1/tokens", json=body))
            if args.json:
                _print(made)
            else:
                expires = "never" if made["expires_at"] is None else _when(made["expires_at"])
                print(f"token {made['id']} ({'+'.join(made['scopes'])}, jobs {made['job_pattern'] or '-'}, expires {expires}):")
                print(made["token"])
                print("It is shown only this once: store it now.", file=sys.stderr)
        elif args.token_cmd == "list":
            rows = _check(c.get("/v1/tokens"))
            if args.json:
                _print(rows)
                return 0
            print(f"{'ID':>4} {'NAME':<20} {'SCOPES':<22} {'JOBS':<14} {'EXPIRES':<19} {'STATE':<8} CREATOR")
            for t in rows:
                state = "revoked" if t["revoked_at"] else "live"
                expires = "never" if t["expires_at"] is None else _when(t["expires_at"])
                print(f"{t['id']:>4} {t['name'][:20]:<20} {'+'.join(t['scopes']):<22} {(t['job_pattern'] or '-'):<14} {expires:<19} {state:<8} {t['creator']}")
        else:
            _print(_check(c.delete(f"/v1/tokens/{args.id}")))
    return 0


def _when(t: float) -> str:
    from datetime import datetime

    return datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M:%S")


def _demo(args: argparse.Namespace) -> int:
    from trainguard.demo.run import main as demo_main

    return int(demo_main(list(args.args)) or 0)


def preflight(argv: Sequence[str]) -> int:
    """``trainguard preflight SCRIPT [args]`` / ``-m MODULE [args]``: run the training script up to
    its ``agent.preflight(batch, ...)`` call, print the checks as a table and stop before the first
    training step (a script that reaches an optimizer step without a pre-flight is stopped there).
    Exit status 0 (everything passed or warned), 1 (a check failed), 2 (the script never called
    ``agent.preflight``, or failed before it)."""
    import runpy
    import traceback

    from trainer_agent.preflight import PREFLIGHT_ONLY_ENV, PreflightOnly

    argv = list(argv)
    module = argv[:1] == ["-m"]
    if module:
        argv = argv[1:]
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: trainguard preflight SCRIPT [args...] | trainguard preflight -m MODULE [args...]\n\n"
              "Runs the script until its agent.preflight(batch, ...) call, prints the checks and stops before "
              "training.\nExit status: 0 passed (warnings allowed), 1 a check failed, 2 no pre-flight ran.",
              file=sys.stderr if not argv else sys.stdout)
        return 2 if not argv else 0
    target, rest = argv[0], argv[1:]
    saved_argv, saved_env = sys.argv, os.environ.get(PREFLIGHT_ONLY_ENV)
    os.environ[PREFLIGHT_ONLY_ENV] = "1"
    sys.argv = [target, *rest]
    try:
        if module:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            if not os.path.isfile(target):
                print(f"trainguard preflight: no such script: {target}", file=sys.stderr)
                return 2
            sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
            runpy.run_path(target, run_name="__main__")
    except PreflightOnly as done:
        if done.report is None:
            print(f"trainguard preflight: {target} started training without calling agent.preflight(batch, ...); "
                  "stopped before its first optimizer step", file=sys.stderr)
            return 2
        if done.rank == 0:
            print(done.report.table(), flush=True)
        return 1 if done.report.failed else 0
    except SystemExit as e:
        print(f"trainguard preflight: {target} exited ({e.code}) before calling agent.preflight", file=sys.stderr)
        return 2
    except Exception:  # noqa: BLE001 - the script's own error, shown as it is
        traceback.print_exc()
        print(f"trainguard preflight: {target} failed before its pre-flight ran", file=sys.stderr)
        return 2
    finally:
        sys.argv = saved_argv
        if saved_env is None:
            os.environ.pop(PREFLIGHT_ONLY_ENV, None)
        else:
            os.environ[PREFLIGHT_ONLY_ENV] = saved_env
    print(f"trainguard preflight: {target} finished without calling agent.preflight(batch, ...)", file=sys.stderr)
    return 2


def _dashboards(args: argparse.Namespace) -> int:
    if args.action != "build":
        raise SystemExit("usage: trainguard dashboards build [args...]")
    from trainguard.dashboards.build import main as build_main

    return int(build_main(list(args.args)) or 0)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="trainguard", description="Training-stability monitoring and control.")
    sub = p.add_subparsers(dest="cmd", required=True)
    client = argparse.ArgumentParser(add_help=False)
    client.add_argument("--url", default=os.environ.get("TRAINGUARD_URL", _DEFAULT_URL), help="controller URL (env TRAINGUARD_URL)")
    client.add_argument("--token", default=os.environ.get("TRAINGUARD_TOKEN"), help="bearer token (env TRAINGUARD_TOKEN)")
    client.add_argument("--json", action="store_true", help="print JSON")

    s = sub.add_parser("serve", help="run the controller (env TRAINGUARD_HOST/PORT/DB/RULES and tokens)")
    s.add_argument("--host", default=None, help="bind address (env TRAINGUARD_HOST, default 127.0.0.1)")
    s.add_argument("--port", type=int, default=None, help="port, 0 = any free one (env TRAINGUARD_PORT, default 8000)")
    s.add_argument("--db", default=None, help="SQLite file, or postgresql://user@host/dbname (env TRAINGUARD_DB, default trainguard.db)")
    s.add_argument("--rules", default=None, help="rules YAML (env TRAINGUARD_RULES; default: stored or built-in rules)")
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    s.add_argument("--access-log", action="store_true", help="log every request")
    s.set_defaults(func=_serve)

    s = sub.add_parser("runs", parents=[client], help="list runs")
    s.add_argument("--job")
    s.set_defaults(func=_runs)
    s = sub.add_parser("status", parents=[client], help="a run's status")
    s.add_argument("run")
    s.set_defaults(func=_status)
    for spec in REGISTRY:
        if spec.operator:
            _add_command(sub, client, spec)
    s = sub.add_parser("incidents", parents=[client], help="a run's incidents and the escalation rungs taken")
    s.add_argument("run")
    s.set_defaults(func=_incidents)
    s = sub.add_parser("events", parents=[client], help="a run's audit log")
    s.add_argument("run")
    s.add_argument("--follow", "-f", action="store_true", help="keep streaming new events (Server-Sent Events)")
    s.add_argument("--after", type=int, default=0, help="only events with a larger id")
    s.set_defaults(func=_events)
    s = sub.add_parser("alerts", parents=[client], help="alerts, newest first")
    s.add_argument("--state", choices=["firing", "resolved"])
    s.add_argument("--run")
    s.set_defaults(func=_alerts)
    s = sub.add_parser("rules", help="rules files")
    rsub = s.add_subparsers(dest="rules_cmd", required=True)
    r = rsub.add_parser("check", help="validate a rules file offline")
    r.add_argument("file")
    r.set_defaults(func=_rules_check)

    s = sub.add_parser("token", help="tokens for a fleet: create, list, revoke (needs a token with the tokens scope)")
    tsub = s.add_subparsers(dest="token_cmd", required=True)
    t = tsub.add_parser("create", parents=[client], help="create a token (printed once)")
    t.add_argument("--scope", required=True, help="'agent', or operator scopes joined by '+' (read+command)")
    t.add_argument("--job", default=None, help="agent tokens: jobs whose runs it may register, e.g. 'llm-7b*'")
    t.add_argument("--ttl", type=parse_ttl, default=None, help="lifetime: 30d, 12h, 90m, 3600s (default: none)")
    t.add_argument("--name", default="", help="what it is for")
    t.set_defaults(func=_token)
    t = tsub.add_parser("list", parents=[client], help="list tokens (never the tokens themselves)")
    t.set_defaults(func=_token)
    t = tsub.add_parser("revoke", parents=[client], help="revoke a token by id")
    t.add_argument("id", type=int)
    t.set_defaults(func=_token)

    s = sub.add_parser("demo", help="controller + a 2-rank training run with injected faults (trainguard.demo.run)")
    s.add_argument("args", nargs=argparse.REMAINDER)
    s.set_defaults(func=_demo)
    s = sub.add_parser("preflight", help="run a training script's pre-flight checks only: 'trainguard preflight train.py [args...]'")
    s.add_argument("args", nargs=argparse.REMAINDER)
    s.set_defaults(func=lambda a: preflight(a.args))
    s = sub.add_parser("dashboards", help="dashboards as code: 'trainguard dashboards build [args...]'")
    s.add_argument("action", choices=["build"])
    s.add_argument("args", nargs=argparse.REMAINDER)
    s.set_defaults(func=_dashboards)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """The ``trainguard`` command; its exit status. Output piped into a reader that stops early
    (``trainguard status RUN | head``) ends the command quietly, as other command-line tools end:
    no traceback, and the status a shell reports for a tool ended by SIGPIPE (141)."""
    try:
        code = _main(argv)
        sys.stdout.flush()  # here, not at exit: a reader gone by now is handled below
        return code
    except BrokenPipeError:
        # Nothing more can reach the reader; point stdout at /dev/null so the interpreter's own
        # flush at exit does not fail again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 128 + signal.SIGPIPE


def _main(argv: Sequence[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # ``demo`` and ``dashboards build`` own their options: hand them everything after the name
    # (argparse.REMAINDER does not take options that come first).
    if argv[:1] == ["demo"]:
        from trainguard.demo.run import main as demo_main

        return int(demo_main(argv[1:]) or 0)
    if argv[:1] == ["preflight"]:
        return preflight(argv[1:])
    if argv[:2] == ["dashboards", "build"]:
        from trainguard.dashboards.build import main as build_main

        return int(build_main(argv[2:]) or 0)
    args = _parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except httpx.HTTPError as e:
        print(f"trainguard: cannot reach the controller at {getattr(args, 'url', '?')}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
