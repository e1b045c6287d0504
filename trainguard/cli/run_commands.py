"""The CLI's run commands: one verb per operator command of the registry
(``trainguard.protocol.commands.REGISTRY``), its options the fields of the command's request model
(:func:`trainguard.protocol.command_inputs.command_inputs`), the body validated before it is sent."""

from __future__ import annotations

import argparse
import sys
import uuid
from typing import Any

from pydantic import ValidationError

from trainguard.cli.client import checked, connect, run_name, show
from trainguard.protocol.command_inputs import command_inputs, validation_message
from trainguard.protocol.commands import BY_NAME, CommandSpec

__all__ = ["add_command", "send_command", "add_delete", "delete_run"]


def add_command(sub: Any, client: argparse.ArgumentParser, spec: CommandSpec) -> None:
    """``trainguard <spec.url> RUN [FIRST] [--option ...]``: one option per field of the command's
    body (:func:`trainguard.protocol.command_inputs.command_inputs`); the first field may also be
    given right after RUN (``trainguard lr-scale RUN 0.5``, ``trainguard reset-optimizer RUN a b``)."""
    summary = spec.summary.replace("%", "%%")  # argparse formats help texts with %
    s = sub.add_parser(spec.url, parents=[client], help=summary, description=summary)
    s.add_argument("run", type=run_name)
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
    s.add_argument("--on-restart", action="store_true",
                   help="for a finished run (refused without it): apply it when a job registers the run again")
    s.add_argument("--idempotency-key", default=None, help="default: a fresh UUID")
    s.set_defaults(func=send_command, command=spec.name)


def send_command(args: argparse.Namespace) -> int:
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
    with connect(args) as c:
        answer = checked(c.post(f"/v1/runs/{args.run}/{spec.url}", json=req.model_dump(mode="json", exclude_unset=True),
                                headers={"Idempotency-Key": key}, params={"on_restart": "true"} if args.on_restart else None))
    show(answer)
    if answer.get("applies") == "when_registered_again":
        print(f"trainguard {spec.url}: run {args.run} finished: this applies when a job registers it again", file=sys.stderr)
    return 0


def add_delete(sub: Any, client: argparse.ArgumentParser) -> None:
    """``trainguard delete RUN [--force] [--reason TEXT]``: ``DELETE /v1/runs/{run}``."""
    s = sub.add_parser("delete", parents=[client], help="delete a run: out of the run list and the controller's limits",
                       description="Delete a run: it leaves the run list and the controller's limits, its reports are "
                       "deleted, its audit log is kept (trainguard events RUN), and its name may be registered again. "
                       "A live run (paused, or reporting, and neither finished nor stopped) needs --force.")
    s.add_argument("run", type=run_name)
    s.add_argument("--force", action="store_true", help="delete a live run too (an agent still running registers it again)")
    s.add_argument("--reason", default="", help="why (recorded in the audit log)")
    s.set_defaults(func=delete_run)


def delete_run(args: argparse.Namespace) -> int:
    params = {"force": "true"} if args.force else {}
    if args.reason:
        params["reason"] = args.reason
    with connect(args) as c:
        show(checked(c.delete(f"/v1/runs/{args.run}", params=params)))
    return 0
