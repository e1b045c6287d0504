"""The parts of ``docs/`` that state defaults, generated from the code that has them: the built-in
rules (``service/default_rules.yaml``), the recovery settings, one "what now" section per built-in
rule (its alert's diagnosis), the metric reference (the agent's catalogue and the controller's), and
the CLI's run commands (the command registry's operator commands).

Each generated part sits in a docs page between two markers::

    <!-- generated: rules (python -m trainguard.dashboards.docs_tables) -->
    ...
    <!-- end generated: rules -->

``python -m trainguard.dashboards.docs_tables`` rewrites them in ``docs/`` (``--docs DIR``); ``--check``
only says which differ (exit status 1), which ``tests/docs/test_docs.py`` runs.
"""

from __future__ import annotations

import argparse
import functools
import re
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from trainguard.protocol.catalog import AGENT_METRICS, CONTROL_METRICS, DATA_METRICS, INPUT_METRICS, STEP_METRICS
from trainguard.protocol.catalog import JOB, LAYER, RANK, MetricSpec, series_per_job, series_per_rank
from trainguard.protocol.command_inputs import command_inputs
from trainguard.protocol.commands import REGISTRY
from trainguard.service.diagnosis import diagnosis
from trainguard.service.metrics import CONTROLLER_METRICS
from trainguard.service.cause import HARDWARE_DIAGNOSES
from trainguard.service.desync_layout import LAYOUT_HINT
from trainguard.service.rules import AdaptiveLrAction, NotifyAction, RecoveryPolicy, default_rules_text, load_rules

__all__ = ["BLOCKS", "actions_table", "rules_table", "recovery_table", "rule_sections", "metrics_table", "series_table",
           "render", "main"]

_BEGIN = "<!-- generated: {name} (python -m trainguard.dashboards.docs_tables) -->"
_END = "<!-- end generated: {name} -->"


def _num(x: float) -> str:
    """1000 -> 1000, 0.0001 -> 0.0001, 1e-05 -> 1e-5."""
    text = f"{x:g}"
    return re.sub(r"e([+-])0*(\d)", lambda m: "e" + ("-" if m.group(1) == "-" else "") + m.group(2), text)


@functools.cache
def _built_in() -> Any:
    """The built-in rules file (loaded once)."""
    return load_rules(default_rules_text()).file


def _rules() -> list[Any]:
    return list(_built_in().rules)


def watched(rule: Any) -> str:
    """What a rule reads: a metric of the report, or a per-rank value (``vector``)."""
    parts = []
    if getattr(rule, "metric", None):
        parts.append(f"`{rule.metric}`")
    vectors = getattr(rule, "vectors", ()) or ((rule.vector,) if getattr(rule, "vector", None) else ())
    parts += [f"per-rank `{v}`" for v in vectors]
    return ", ".join(parts) or "the run's reports"


def _threshold_condition(rule: Any) -> str:
    """:func:`condition` of a threshold rule."""
    text = f"{rule.op} {_num(rule.value)}"
    text += f" in {rule.for_reports} reports in a row" if rule.for_reports > 1 else ""
    if rule.crossing_window:
        text += f", crossing it (within it in one of the {rule.crossing_window} reports before"
        text += f", and {_num(rule.crossing_rise)}x its level there)" if rule.crossing_rise != 1.0 else ")"
    if rule.settle_steps:
        text += (f" ({rule.op} {_num(rule.settle_value)} over" if rule.settle_value is not None else " (not judged over")
        text += (f" the first {rule.settle_steps} steps of a fresh optimizer state: the run's, a new optimizer's,"
                 " those of parameters that start to train or of a job resumed without its optimizer's state)")
    return text


def _rate_condition(rule: Any) -> str:
    span = f"the newest ≥ {_num(rule.min_steps)} `{rule.per}` (up to {rule.window} reports)" if rule.min_steps \
        else f"{rule.window} reports"
    startup = f", its start-up (the counter equal to `{rule.per}`) left out" if rule.leave_out_startup else ""
    return f"grows by > {_num(rule.value)} per `{rule.per}` over {span}{startup}"


def condition(rule: Any) -> str:
    """When the rule fires, in words, with the numbers of the rules file."""
    kind = rule.kind
    if kind == "threshold":
        return _threshold_condition(rule)
    if kind == "nonfinite":
        if rule.scaler_halvings:
            return (f"NaN or ±Inf, except on steps a GradScaler skipped while its scale is within {rule.scaler_halvings} "
                    f"halving(s) of its median over {rule.scaler_window} reports (or before its first step)")
        return "NaN or ±Inf"
    if kind == "spike":
        base = "rolling median" if rule.baseline == "median" else "moving average"
        if rule.mode == "ratio":
            text = f"≥ {_num(rule.ratio)}× its {base} of {rule.window} reports"
        else:
            text = f"≥ {_num(rule.z)} robust σ from its {base} of {rule.window} reports"
        text += f" (after {rule.min_history})" + ("" if rule.direction == "up" else f", {rule.direction}")
        if rule.trend_with and (rule.mode, rule.baseline, rule.direction) == ("ratio", "median", "up"):
            text += (f" and of its own rising trend there when it climbed report by report (≤ 2× the 3 before)"
                     f" while `{rule.trend_with}` is not above its median")
        return text + (f", unless it is a level visited and left {rule.recurring} times there" if rule.recurring else "")
    if kind == "trend":
        if rule.direction == "not_decreasing":
            text = f"not decreasing over {rule.window} reports"
            if rule.min_run_fraction:
                text += f" covering ≥ {_num(100 * rule.min_run_fraction)} % of the run's steps (its latter part)"
            return text
        return f"rising in every report, by ≥ {_num(100 * rule.min_rel_change)} % over {rule.window} reports"
    if kind == "rate":
        return _rate_condition(rule)
    if kind == "cross_rank":
        if rule.check == "spread":
            text = f"a rank ≥ {_num(rule.ratio)}× the median of the other ranks"
            text += f" and ≥ {_num(rule.min_value)}" if rule.min_value else ""
            span = f"the last {rule.for_steps} steps, {rule.for_reports} at least" if rule.for_steps else f"the last {rule.for_reports}"
            return text + f", the same rank in more than half of the reports of {span}"
        elif rule.check == "above":
            text = f"some rank ≥ {_num(rule.value)}"
        else:
            text = f"some rank differs from the median by > {_num(rule.rel_tol)} relative"
        return text + (f", the same rank in {rule.for_reports} reports in a row" if rule.for_reports > 1 else "")
    if kind == "desync":
        return f"some rank differs by > {_num(rule.rel_tol)} relative in a layer"
    if kind == "oscillation":
        return (f"a periodic swing over {rule.window} reports (≥ {_num(100 * rule.min_power)} % of the variance, "
                f"recurring a period later: autocorrelation ≥ {_num(rule.min_autocorrelation)}, "
                f"amplitude ≥ {_num(100 * rule.min_rel_amplitude)} % of the mean)")
    if kind == "absence":
        return f"no report for {_num(rule.seconds)} s"
    raise ValueError(f"no wording for rules of kind {kind!r}")


def action(a: Any) -> str:
    """One action as the table shows it: its type in backticks and what qualifies it."""
    if a.type == "rollback":
        notes = []
        if a.unless_skipped:
            notes.append("unless the step was not taken")
        if a.lr_factor != 1.0:
            notes.append(f"lr_scale × {_num(a.lr_factor)}")
        return "`rollback`" + (f" ({', '.join(notes)})" if notes else "")
    if a.type == "lr_scale":
        return f"`lr_scale` ({'× ' + _num(a.factor) if a.factor is not None else '= ' + _num(a.value)})"
    if a.type == "accumulation":
        return f"`accumulation` (× {_num(a.factor)}, {a.min_steps}–{a.max_steps} steps, LR {a.lr_rule})"
    return f"`{a.type}`"


#: What each action does to the run, in the operating page.
_ACTION_WORDS: dict[str, str] = {
    "notify": "sends the alert to the console, the event stream and the webhooks",
    "pause": "pauses every rank at the same step (page a human; `trainguard resume RUN` goes on)",
    "adaptive_lr": ("lowers `lr_scale` so that the update ratio returns to its level before the trouble; "
                    "once the run is stable again the controller ramps it back"),
    "rollback": "rolls every rank back to the newest snapshot taken before the trouble (with snapshots on)",
    "lr_scale": "multiplies the run's `lr_scale`",
    "checkpoint": "asks every rank to save a checkpoint at the same step",
    "stop": "saves a checkpoint and stops every rank at the same step",
    "memory_trace": ("traces the next few steps and records which layer, or the training loop, keeps memory "
                     "alive (`memory_report` in `trainguard status RUN`)"),
    "verify": "recomputes the next step's gradient on every rank and compares it with the one the step used",
    "accumulation": ("multiplied the run's gradient accumulation steps (a run that opted in; the LR following by the "
                     "action's rule, the new steps applied by every rank at the same step)"),
}


def _first_sentence(text: str | None) -> str:
    text = " ".join((text or "").split()).replace("``", "`").removeprefix("Rule action: ")
    return (text[:1].upper() + text[1:]).split(". ")[0].rstrip(".") if text else ""


def actions_table() -> str:
    """Every action a rule may take: ``notify``, ``adaptive_lr`` and each command of the registry
    with a rule action, with its fields and their defaults."""
    rows = ["| action | what it does | fields (default) |", "|---|---|---|"]
    own = [(NotifyAction, _first_sentence(NotifyAction.__doc__)), (AdaptiveLrAction, _first_sentence(AdaptiveLrAction.__doc__))]
    commands = [(spec.rule_action, (_first_sentence(spec.rule_action.__doc__) or spec.summary) +
                 (" (an optimizer remedy: a rung `ladders.optimizer` may name)" if spec.remedy else ""))
                for spec in REGISTRY if spec.rule_action]
    for model, what in own + commands:
        fields = []
        for name, f in model.model_fields.items():
            if name == "type":
                continue
            default = f.get_default(call_default_factory=True)
            shown = "required" if f.is_required() else "none" if default is None else "[]" if default == () else _num(default) if isinstance(default, float) else str(default).lower()
            fields.append(f"`{name}` ({shown})")
        rows.append(f"| `{model.model_fields['type'].default}` | {what.replace('|', '/')} | {', '.join(fields) or '—'} |")
    return "\n".join(rows)


def rules_table() -> str:
    """The built-in rules, one row each, in the rules file's order."""
    rows = ["| rule | severity | watches | fires when | actions |", "|---|---|---|---|---|"]
    for rule in _rules():
        actions = ", ".join(action(a) for a in rule.actions)
        if rule.diagnosis in HARDWARE_DIAGNOSES:
            actions += "; a hardware cause: `ladders.hardware`"
        off = "" if rule.enabled else " (off: opt in with `enabled: true`)"
        rows.append(f"| `{rule.name}` | {rule.severity} | {watched(rule)} | {condition(rule)}{off} | {actions} |")
    return "\n".join(rows)


def recovery_table() -> str:
    """The ``recovery`` section's settings: the built-in value and what each means."""
    built_in = _built_in().recovery
    rows = ["| setting | built-in | meaning |", "|---|---|---|"]
    for name, field in RecoveryPolicy.model_fields.items():
        value = getattr(built_in, name)
        if isinstance(value, tuple):
            shown = "[" + ", ".join(str(v) for v in value) + "]"
        elif hasattr(value, "model_dump"):
            shown = "; ".join(f"{k}: [{', '.join(v)}]" for k, v in value.model_dump().items() if v is not None)
        else:
            shown = _num(value) if isinstance(value, float) else str(value)
        meaning = field.description or {"enabled": "Recovery without a human on or off.",
                                        "ladder": "The rungs an incident climbs, in order (an optimizer fault's)."}.get(name, "")
        rows.append(f"| `{name}` | `{shown}` | {meaning} |")
    return "\n".join(rows)


#: What a hardware rule's alert does not make hardware evidence of, per diagnosis.
_NOT_HARDWARE = {
    "gpu_xid": "an XID of the application's own kernels (13, 31, 43) or one the driver contained (63, 94) only notifies",
    "grad_desync": f"a desync of more than half the ranks of a job of three or more only notifies: it is taken as "
                   f"{LAYOUT_HINT}",
}
_NOT_HARDWARE["param_desync"] = _NOT_HARDWARE["grad_desync"]


def _hardware_ladder(diagnosis: str) -> str:
    """What a hardware rule's alert does beyond notifying: the built-in hardware ladder's rungs."""
    ladder = _built_in().recovery.ladders.hardware or ()
    rungs = ", then ".join(f"`{r}`" for r in ladder)
    text = ("Its alert is hardware evidence: with recovery on, the controller's cause verdict is `hardware`, naming "
            f"the ranks and their nodes, and an incident opens that climbs `ladders.hardware` ({rungs}: every rank "
            "checkpoints at the same step, then the run is paused and a human paged)")
    return text + ("; " + _NOT_HARDWARE[diagnosis] if diagnosis in _NOT_HARDWARE else "")


def rule_sections() -> str:
    """One section per built-in rule: what it means, what trainguard already did, what to do."""
    out = []
    for rule in _rules():
        d = diagnosis(rule.diagnosis)
        did = "; ".join(f"`{a.type}` {_ACTION_WORDS[a.type]}" for a in rule.actions)
        if rule.diagnosis in HARDWARE_DIAGNOSES:
            did += ". " + _hardware_ladder(rule.diagnosis)
        elif all(a.type == "notify" for a in rule.actions):
            did += ". Nothing in the run changed: what to do is yours to judge"
        if any(a.type == "rollback" and a.unless_skipped for a in rule.actions):
            did += (". A rollback is not taken when the step was not taken (the agent, or the mixed-precision "
                    "loss scaler, skipped it: the weights are intact, the recovery ladder watches instead)")
        lines = [
            f"### `{rule.name}`",
            "",
            f"**{rule.severity}** · watches {watched(rule)} · fires when: {condition(rule)}",
            "",
            f"**What it means.** {rule.description or d.symptom + '. ' + d.source}",
            "",
            f"**What trainguard already did.** {did}.",
            "",
            "**Likely causes.** " + "; ".join(d.likely_causes) + ".",
            "",
            "**What to do.**",
            "",
            *[f"{i}. {step.rstrip('.')}." for i, step in enumerate(d.suggested_actions, start=1)],
        ]
        out.append("\n".join(lines))
    return "\n\n".join(out)


#: Which ranks serve a metric of each catalogue scope (``catalog.exported_scopes``), in words.
_SERVED_BY = {RANK: "every rank", JOB: "rank 0", LAYER: "rank 0 (`per_layer`)"}


def _metric_rows(metrics: Iterable[MetricSpec], served_by: bool = True) -> list[str]:
    if served_by:
        rows = ["| metric | type | unit | labels | served by | meaning |", "|---|---|---|---|---|---|"]
    else:
        rows = ["| metric | type | unit | labels | meaning |", "|---|---|---|---|---|"]
    for m in metrics:
        labels = ", ".join(f"`{label}`" for label in m.labels) or "—"
        scope = f" {_SERVED_BY[m.scope]} |" if served_by else ""
        rows.append(f"| `{m.name}` | {m.kind} | {m.unit} | {labels} |{scope} {m.help.replace('|', '/')} |")
    return rows


def metrics_table() -> str:
    """Every metric a training rank exports, by group, then the controller's."""
    groups = (("Step", STEP_METRICS), ("Data quality", DATA_METRICS), ("Control loop", CONTROL_METRICS),
              ("Input", INPUT_METRICS))
    assert sum(len(g) for _, g in groups) == len(AGENT_METRICS)
    parts = []
    for title, metrics in groups:
        parts.append(f"#### {title} (each with the labels `job`, `run`, `rank`)\n\n" + "\n".join(_metric_rows(metrics)))
    parts.append("#### The controller's own (`GET /metrics` of the controller)\n\n"
                 + "\n".join(_metric_rows(CONTROLLER_METRICS, served_by=False)))
    return "\n\n".join(parts)


#: The job sizes and depths of the series table (``series_table``; ``bench/series_count.py``).
SERIES_RANKS = (8, 512, 4096, 32768)
SERIES_LAYERS = (15, 131)


def series_table() -> str:
    """Series per rank and per job when every catalogued metric has a value (one param group), by
    job size, depth and ``per_layer``, from ``catalog.series_per_rank``/``series_per_job``; beside
    them what ``job_metrics="all"`` (a copy of the job's values on every rank) serves."""
    own = series_per_rank(1, layers=0)
    job = series_per_rank(0, layers=0) - own
    per_layer = series_per_rank(0, layers=1) - own - job
    formula = (f"With W ranks and L layers: W × R + J + M × L series per job (`per_layer=\"all\"`: "
               f"W × (R + M × L) + J), where R = {own} series of each rank's own, J = {job} of the job "
               f"(with one param group; one more per group) and M = {per_layer} per-layer metrics; "
               f"`job_metrics=\"all\"` adds (W − 1) × J.")
    rows = [formula, "",
            "| ranks | layers | `per_layer` | rank 0 | each other rank | per job | per job with `job_metrics=\"all\"` |",
            "|---|---|---|---|---|---|---|"]
    for world in SERIES_RANKS:
        for layers in SERIES_LAYERS:
            for per_layer in ("rank0", "all"):
                kw = dict(layers=layers, per_layer=per_layer)
                rows.append(f"| {world:,} | {layers} | `{per_layer}` | {series_per_rank(0, **kw):,} | "
                            f"{series_per_rank(1, **kw):,} | {series_per_job(world, **kw):,} | "
                            f"{series_per_job(world, job_metrics='all', **kw):,} |")
    return "\n".join(rows)


def commands_table() -> str:
    """The run commands of the CLI (one per operator command of the registry): usage, what each
    does, its options (the fields of its request model)."""
    rows = ["| command | what it does | options (the first also right after RUN) |", "|---|---|---|"]
    for spec in REGISTRY:
        if not spec.operator:
            continue
        inputs = command_inputs(spec.request)
        first = "" if not inputs else f" [{inputs[0].metavar}{' ...' if inputs[0].type == 'list' else ''}]"
        opts = []
        for inp in inputs:
            kind = "/".join(inp.choices) if inp.choices else "text" if inp.type == "list" else inp.type
            opts.append(f"`{inp.option}` {kind}" + (f" ({inp.notes()})" if inp.notes() else ""))
        rows.append(f"| `trainguard {spec.url} RUN{first}` | {spec.summary.replace('|', '/')} | {'; '.join(opts) or '—'} |")
    return "\n".join(rows)


#: Page -> the generated parts in it.
BLOCKS: dict[str, dict[str, Callable[[], str]]] = {
    "controller.md": {"commands": commands_table},
    "rules.md": {"rules": rules_table, "actions": actions_table, "recovery": recovery_table},
    "operating.md": {"rule-sections": rule_sections},
    "metrics.md": {"metrics": metrics_table, "series": series_table},
}


def render(text: str, blocks: dict[str, Callable[[], str]]) -> str:
    """``text`` with each named part between its markers replaced by what its function produces;
    ``ValueError`` for a part whose markers are missing."""
    for name, make in blocks.items():
        begin, end = _BEGIN.format(name=name), _END.format(name=name)
        pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.S)
        if not pattern.search(text):
            raise ValueError(f"the markers of the generated part {name!r} are missing: {begin} ... {end}")
        text = pattern.sub(lambda _: f"{begin}\n\n{make()}\n\n{end}", text, count=1)
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainguard.dashboards.docs_tables", description=__doc__.split("\n\n")[0])
    parser.add_argument("--docs", default="docs", help="the docs folder (default: ./docs)")
    parser.add_argument("--check", action="store_true", help="only report the pages that differ (exit status 1)")
    args = parser.parse_args(argv)
    paths = {Path(args.docs) / page: blocks for page, blocks in BLOCKS.items()}
    if missing := [path for path in paths if not path.is_file()]:  # e.g. where installed, not in a checkout
        parser.error(f"{missing[0]} is not there: run it in the repository's root, or name the docs folder with --docs")
    stale = []
    for path, blocks in paths.items():
        text = path.read_text(encoding="utf-8")
        new = render(text, blocks)
        if new != text:
            stale.append(str(path))
            if not args.check:
                path.write_text(new, encoding="utf-8")
    print(f"{'differ from the code' if args.check else 'rewritten'}: {', '.join(stale)}" if stale
          else "docs: the generated parts are up to date")
    return 1 if stale and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
