"""``trainguard``: start the controller, and talk to it.

    trainguard serve --host 127.0.0.1 --port 8000 --db trainguard.db --rules rules.yaml
    trainguard runs
    trainguard status RUN
    trainguard delete RUN [--force] --reason "debugging run"
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

The reads are in ``reads.py``, the run commands in ``run_commands.py``, the HTTP client in
``client.py``; ``python -m trainguard.cli`` runs :func:`main`.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import os
import signal
import socket
import sys
from typing import Any, Iterator, Sequence

import httpx
from pydantic import ValidationError

from trainguard.cli import reads
from trainguard.cli.client import DEFAULT_URL, run_name
from trainguard.cli.reads import format_incidents, format_verdict
from trainguard.cli.run_commands import add_command, add_delete
from trainguard.cli.tokens import add_token, parse_ttl
from trainguard.protocol.commands import REGISTRY

__all__ = ["main", "format_incidents", "format_verdict", "parse_ttl", "preflight"]

# -- serve ------------------------------------------------------------------------------------
def _serve(args: argparse.Namespace) -> int:
    from trainguard.service.app import create_app
    from trainguard.service.config import Settings
    from trainguard.service.group_commit import StoreError
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
    except (RulesError, ValueError, OSError, StoreError) as e:
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
    # Everything built so far (modules, the app, and the runs and windows once read back from
    # the database) lives as long as the process: keep it out of the collector's full passes, which
    # otherwise walk it all (~12 ms with the default rules and 200 runs) every few thousand reports.
    gc.collect()
    gc.freeze()
    app.state.startup.freeze_gc = True  # again once the runs are read back (service/startup.py)
    ControllerServer(config, app.state.controller).run(sockets=[sock])
    return 0


# -- client commands ----------------------------------------------------------------------------






def _rules_check(args: argparse.Namespace) -> int:
    from trainguard.service.rules import RulesError, load_rules, require_rules

    try:
        with open(args.file, encoding="utf-8") as f:
            rs = load_rules(f.read(), check_names=True)
        require_rules(rs, remove_all=True, source="file")  # as the controller reads a --rules file
    except (OSError, RulesError, UnicodeDecodeError) as e:
        print(f"{args.file}: {e}", file=sys.stderr)
        return 1
    off = len(rs.file.rules) - len(rs.base)  # rules turned off (enabled: false): validated, not evaluated
    print(f"{args.file}: {len(rs.base)} rules" + (f" ({off} more turned off)" if off else "")
          + f", overrides for {len(rs.by_job)} job(s): OK")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from trainguard.demo.run import main as demo_main

    return int(demo_main(list(args.args)) or 0)


def preflight(argv: Sequence[str]) -> int:
    """``trainguard preflight SCRIPT [args]`` / ``-m MODULE [args]``: run the training script up to
    its ``agent.preflight(batch, ...)`` call, print the checks as a table and stop before the first
    training step (a script that reaches an optimizer step without a pre-flight is stopped there).
    Exit status 0 (everything passed or warned), 1 (a check failed), 2 (the script never called
    ``agent.preflight``, or failed before it)."""
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
    with _preflight_only([target, *rest]):
        status = _run_to_preflight(target, module)
    if status is not None:
        return status
    print(f"trainguard preflight: {target} finished without calling agent.preflight(batch, ...)", file=sys.stderr)
    return 2


@contextlib.contextmanager
def _preflight_only(argv: list[str]) -> Iterator[None]:
    """Run with ``sys.argv`` set to the script's and the agent told to stop at its pre-flight;
    both restored afterwards."""
    from trainer_agent.diagnostics.preflight import PREFLIGHT_ONLY_ENV

    saved_argv, saved_env = sys.argv, os.environ.get(PREFLIGHT_ONLY_ENV)
    os.environ[PREFLIGHT_ONLY_ENV] = "1"
    sys.argv = argv
    try:
        yield
    finally:
        sys.argv = saved_argv
        if saved_env is None:
            os.environ.pop(PREFLIGHT_ONLY_ENV, None)
        else:
            os.environ[PREFLIGHT_ONLY_ENV] = saved_env


def _run_to_preflight(target: str, module: bool) -> int | None:
    """Run the script (or module) until the agent stops it at its pre-flight: the exit status, or
    ``None`` when it finished without one."""
    import runpy
    import traceback

    from trainer_agent.diagnostics.preflight import PreflightOnly

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
    return None


def _dashboards(args: argparse.Namespace) -> int:
    if args.action != "build":
        raise SystemExit("usage: trainguard dashboards build [args...]")
    from trainguard.dashboards.build import main as build_main

    return int(build_main(list(args.args)) or 0)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="trainguard", description="Training-stability monitoring and control.")
    sub = p.add_subparsers(dest="cmd", required=True)
    client = _client_options()
    _add_serve(sub)
    _add_run_commands(sub, client)
    _add_rules(sub)
    add_token(sub, client)
    _add_wrappers(sub)
    return p


def _client_options() -> argparse.ArgumentParser:
    """The options every client command takes (a parent parser)."""
    client = argparse.ArgumentParser(add_help=False)
    client.add_argument("--url", default=os.environ.get("TRAINGUARD_URL", DEFAULT_URL), help="controller URL (env TRAINGUARD_URL)")
    client.add_argument("--token", default=os.environ.get("TRAINGUARD_TOKEN"), help="bearer token (env TRAINGUARD_TOKEN)")
    client.add_argument("--json", action="store_true", help="print JSON")
    return client


def _add_serve(sub: Any) -> None:
    s = sub.add_parser("serve", help="run the controller (env TRAINGUARD_HOST/PORT/DB/RULES and tokens)")
    s.add_argument("--host", default=None, help="bind address (env TRAINGUARD_HOST, default 127.0.0.1)")
    s.add_argument("--port", type=int, default=None, help="port, 0 = any free one (env TRAINGUARD_PORT, default 8000)")
    s.add_argument("--db", default=None, help="SQLite file, or postgresql://user@host/dbname (env TRAINGUARD_DB, default trainguard.db)")
    s.add_argument("--rules", default=None, help="rules YAML (env TRAINGUARD_RULES; default: stored or built-in rules)")
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    s.add_argument("--access-log", action="store_true", help="log every request")
    s.set_defaults(func=_serve)


def _add_run_commands(sub: Any, client: argparse.ArgumentParser) -> None:
    """The reads of runs and alerts, and the registry's operator commands among them."""
    s = sub.add_parser("runs", parents=[client], help="list runs")
    s.add_argument("--job")
    s.set_defaults(func=reads.runs)
    s = sub.add_parser("status", parents=[client], help="a run's status")
    s.add_argument("run", type=run_name)
    s.set_defaults(func=reads.status)
    for spec in REGISTRY:
        if spec.operator:
            add_command(sub, client, spec)
    add_delete(sub, client)
    s = sub.add_parser("incidents", parents=[client], help="a run's incidents and the escalation rungs taken")
    s.add_argument("run", type=run_name)
    s.set_defaults(func=reads.incidents)
    s = sub.add_parser("events", parents=[client], help="a run's audit log")
    s.add_argument("run", type=run_name)
    s.add_argument("--follow", "-f", action="store_true", help="keep streaming new events (Server-Sent Events)")
    s.add_argument("--after", type=int, default=0, help="only events with a larger id")
    s.set_defaults(func=reads.events)
    s = sub.add_parser("alerts", parents=[client], help="alerts, newest first")
    s.add_argument("--state", choices=["firing", "resolved"])
    s.add_argument("--run", type=run_name)
    s.set_defaults(func=reads.alerts)


def _add_rules(sub: Any) -> None:
    s = sub.add_parser("rules", help="rules files")
    rsub = s.add_subparsers(dest="rules_cmd", required=True)
    r = rsub.add_parser("check", help="validate a rules file offline")
    r.add_argument("file")
    r.set_defaults(func=_rules_check)


def _add_wrappers(sub: Any) -> None:
    """The commands that hand their arguments on: demo, preflight, dashboards."""
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


#: The packages of the extras (pyproject.toml), by import name: a command run where its extra is
#: not installed (``trainguard serve`` after ``pip install 'trainguard[agent]'``) names the extra.
_EXTRA_MODULES = {
    "service": {"fastapi", "uvicorn", "httptools", "pydantic_settings", "yaml"},
    "dashboards": {"grafanalib", "yaml"},
    "agent": {"torch"},
    "service,postgres": {"psycopg", "psycopg_pool"},
    "agent,hf": {"transformers", "accelerate"},
    "agent,lightning": {"lightning"},
}
#: The extras a command needs whole, named at once when one of their packages is missing
#: (``trainguard demo`` trains and runs the controller: ``agent`` alone would fail next on FastAPI).
_COMMAND_EXTRAS = {"serve": "service", "rules": "service", "demo": "agent,service", "dashboards": "dashboards",
                   "preflight": "agent"}


def _install_hint(command: str, module: str) -> str | None:
    """The extras to name where ``module`` is missing when ``command`` runs: the command's own when
    they install it, else the extras that install it; None for a package no extra installs."""
    own = _COMMAND_EXTRAS.get(command)
    if own is not None and any(module in _EXTRA_MODULES[e] for e in own.split(",")):
        return own
    return next((extras for extras, modules in _EXTRA_MODULES.items() if module in modules), None)


def _demo_needs(args: Sequence[str]) -> None:
    """What ``trainguard demo`` imports, checked before it starts anything: torch for its ranks and,
    unless it uses a running controller (``--controller``), the controller's packages (its
    controller, a child process, would otherwise fail after the demo had started)."""
    modules = ["torch"]
    if not any(a == "--controller" or a.startswith("--controller=") for a in args):
        modules += ["fastapi", "uvicorn", "pydantic_settings", "yaml"]
    for module in modules:
        if importlib.util.find_spec(module) is None:
            raise ModuleNotFoundError(f"No module named {module!r}", name=module)


def main(argv: Sequence[str] | None = None) -> int:
    """The ``trainguard`` command; its exit status. Output piped into a reader that stops early
    (``trainguard status RUN | head``) ends the command quietly, as other command-line tools end:
    no traceback, and the status a shell reports for a tool ended by SIGPIPE (141)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        code = _main(argv)
        sys.stdout.flush()  # here, not at exit: a reader gone by now is handled below
        return code
    except ModuleNotFoundError as e:
        extra = _install_hint(argv[0] if argv else "", (e.name or "").split(".")[0])
        if extra is None:
            raise
        print(f"trainguard: this command needs {e.name!r}, which this environment lacks: "
              f"pip install 'trainguard[{extra}]'", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # Nothing more can reach the reader; point stdout at /dev/null so the interpreter's own
        # flush at exit does not fail again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 128 + signal.SIGPIPE


def _main(argv: list[str]) -> int:
    # ``demo`` and ``dashboards build`` own their options: hand them everything after the name
    # (argparse.REMAINDER does not take options that come first).
    if argv[:1] == ["demo"]:
        _demo_needs(argv[1:])
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
    except httpx.InvalidURL as e:  # (not an HTTPError: a --url that is no URL)
        print(f"trainguard: --url {getattr(args, 'url', '?')!r} is not a URL: {e}", file=sys.stderr)
        return 1
    except UnicodeEncodeError:  # (a header holds ASCII only: the token)
        print("trainguard: --token must be ASCII text (a token as the controller printed it)", file=sys.stderr)
        return 1

