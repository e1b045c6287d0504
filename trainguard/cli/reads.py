"""The CLI's reads: ``trainguard runs``, ``status``, ``incidents``, ``events`` and ``alerts``, and
the incidents as text (also the demo's)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from trainguard.cli.client import checked, connect, show
from trainguard.protocol.base import NON_FINITE_STRINGS, printable

__all__ = ["runs", "status", "incidents", "events", "alerts", "format_incidents", "format_verdict", "evidence_text"]


def runs(args: argparse.Namespace) -> int:
    with connect(args) as c:
        runs = checked(c.get("/v1/runs", params={"job": args.job} if args.job else None))
    if args.json:
        show(runs)
        return 0
    print(f"{'RUN':<28} {'JOB':<20} {'STATUS':<10} {'STEP':>9} {'GEN':>4} {'APPLIED':>7}  FIRING")
    for r in runs:
        last = r["finished_step"] if r.get("finished_step") is not None else r["last_step"]  # a finished run: its final step
        step = "" if last is None else last
        print(f"{r['run']:<28} {r['job']:<20} {r['status']:<10} {step:>9} {r['desired_generation']:>4} {r['applied_generation']:>7}  {','.join(r['firing'])}")
    return 0


def status(args: argparse.Namespace) -> int:
    with connect(args) as c:
        show(checked(c.get(f"/v1/runs/{args.run}")))
    return 0


def incidents(args: argparse.Namespace) -> int:
    with connect(args) as c:
        body = checked(c.get(f"/v1/runs/{args.run}/incidents"))
    if args.json:
        show(body)
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
        ref = "" if e.get("reference") is None else f" (against {evidence_text(e['reference'])})"
        lines.append(f"    {e['points_to']:<9} {e['signal']} = {evidence_text(e['value'])}{ref}: {e['detail']}")
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
    for shard, indices in (inc.get("quarantined") or {}).items():
        shown = ", ".join(str(i) for i in indices[:20]) + (f", ... ({len(indices)} in all)" if len(indices) > 20 else "")
        lines.append(f"  quarantined in {shard}: sequences {shown}")
    return lines


def evidence_text(value: Any) -> str:
    """An evidence value (a number, a rank -> value map, a list, ...) as JSON, but with its
    numbers as Python prints them: the wire's ``"NaN"``, ``"Infinity"`` and ``"-Infinity"`` are
    nan, inf and -inf, unquoted like every other number."""
    if isinstance(value, str):
        return repr(NON_FINITE_STRINGS[value]) if value in NON_FINITE_STRINGS else json.dumps(value)
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(str(k))}: {evidence_text(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(evidence_text(v) for v in value) + "]"
    return repr(value) if isinstance(value, float) else json.dumps(value)  # (a float NaN: nan, as JSON: NaN)


def _fmt_event(ev: dict[str, Any]) -> str:
    from datetime import datetime

    when = datetime.fromtimestamp(ev["time"]).strftime("%Y-%m-%d %H:%M:%S")
    gen = "" if ev.get("generation") is None else f" gen={ev['generation']}"
    # (escaped: a reason is free text, and a control character would act on the terminal)
    return f"{ev['id']:>6} {when} {ev['run']} {ev['kind']:<10} {printable(ev['actor'])}{gen}: {printable(ev['reason'])}"


def events(args: argparse.Namespace) -> int:
    with connect(args, timeout=None if args.follow else 10.0) as c:
        if not args.follow:
            for ev in checked(c.get(f"/v1/runs/{args.run}/events", params={"after": args.after})):
                print(json.dumps(ev) if args.json else _fmt_event(ev))
            return 0
        checked(c.get(f"/v1/runs/{args.run}"))  # a run that does not exist: 404 now, not a stream of nothing
        params = {"run": args.run, "after": args.after}
        try:
            with c.stream("GET", "/v1/events/stream", params=params) as resp:
                if resp.status_code >= 400:
                    resp.read()
                    checked(resp)
                for line in resp.iter_lines():
                    if line.startswith("data: "):
                        ev = json.loads(line[6:])
                        print(json.dumps(ev) if args.json else _fmt_event(ev), flush=True)
        except KeyboardInterrupt:
            return 0
    return 0


def alerts(args: argparse.Namespace) -> int:
    params = {k: v for k, v in (("state", args.state), ("run", args.run)) if v}
    with connect(args) as c:
        alerts = checked(c.get("/v1/alerts", params=params))
    if args.json:
        show(alerts)
    else:
        for a in alerts:
            print(f"{a['id']:>6} {a['state']:<8} {a['severity']:<8} {a['run']:<24} {a['rule']:<24} {a['summary']}")
    return 0
