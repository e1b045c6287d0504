"""The README and ``docs/`` against the code: the generated parts are current
(``trainguard.dashboards.docs_tables``), the rules table says what the built-in rules file says
(read here with plain YAML), every built-in rule has its "what now" section, every catalogued
metric is in the metric reference, the CLI's commands are the ones ``trainguard --help`` lists,
every relative link resolves, every controller setting's environment variable is named and every
variable named is read, and the README keeps its two commands on top and stays short.
The demo's stated duration is checked against a measured run in ``tests/demo/test_demo_story.py``."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from trainguard.dashboards import docs_tables
from trainguard.protocol.catalog import AGENT_METRICS
from trainguard.service.metrics import CONTROLLER_METRICS
from trainguard.service.rules import default_rules_text

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.glob("*.md"))
#: The first two lines of the README's code: the demo, and the test command CI runs.
COMMANDS = (
    "    bash scripts/setup.sh && .venv/bin/trainguard demo          # set up, then run the demo (controller + a 2-rank training run with injected faults)",
    "    bash scripts/setup.sh && .venv/bin/python -m pytest -q      # set up, then run the tests",
)


def _block(page: str, name: str) -> str:
    text = (DOCS / page).read_text(encoding="utf-8")
    m = re.search(re.escape(f"<!-- generated: {name} ") + r".*?-->\n(.*?)\n" + re.escape(f"<!-- end generated: {name} -->"),
                  text, re.S)
    assert m, f"docs/{page} has no generated part {name!r}"
    return m.group(1).strip("\n")


def _cells(row: str) -> list[str]:
    return [c.strip() for c in row.strip().strip("|").split("|")]


@pytest.mark.parametrize(("page", "blocks"), sorted(docs_tables.BLOCKS.items()))
def test_generated_parts_are_current(page: str, blocks) -> None:
    for name, make in blocks.items():
        assert _block(page, name) == make(), (f"docs/{page}: the part {name!r} differs from the code; run "
                                              "python -m trainguard.dashboards.docs_tables")


def test_rules_table_says_what_the_built_in_rules_file_says() -> None:
    raw = yaml.safe_load(default_rules_text())["rules"]
    rows = [_cells(r) for r in _block("rules.md", "rules").splitlines()[2:]]
    assert [r[0].strip("`") for r in rows] == [r["name"] for r in raw]
    for (name, severity, watches, when, actions), rule in zip(rows, raw):
        assert severity == rule.get("severity", "warning"), name
        for key in ("metric", "vector"):
            if key in rule:
                assert f"`{rule[key]}`" in watches, name
        for vector in rule.get("vectors", []):
            assert f"per-rank `{vector}`" in watches, name
        types = [a if isinstance(a, str) else a["type"] for a in rule["actions"]]
        assert re.findall(r"`([a-z_]+)`", actions) == types, name
        unless = [a for a in rule["actions"] if isinstance(a, dict) and a.get("unless_skipped")]
        assert ("unless the step was not taken" in actions) == bool(unless), name
        # the rule's limit is in the condition as the file writes it (1.0e-5 reads 1e-5)
        for key in ("value", "ratio", "z", "seconds", "rel_tol"):
            if key in rule and not (rule["kind"] == "cross_rank" and key == "ratio" and rule["check"] != "spread"):
                assert re.sub(r"e(-?)0*(\d)", r"e\1\2", f"{float(rule[key]):g}") in when, (name, key, when)
        if rule["kind"] == "threshold":
            assert when.startswith(f"{rule['op']} "), name
        assert ("(off: opt in" in when) == (rule.get("enabled", True) is False), name


def test_the_built_in_rules_are_not_what_the_old_readme_said() -> None:
    """The README once said "loss NaN -> pause" and "LR x 0.5"; the rules file says otherwise."""
    table = _block("rules.md", "rules")
    assert "| `loss_nonfinite` | critical | `trainguard_loss`, per-rank `loss` | NaN or ±Inf | `rollback` (unless the step was not taken), `notify` |" in table
    for rule in ("grad_norm_high", "grad_norm_spike", "update_ratio_spike"):
        (row,) = [r for r in table.splitlines() if r.startswith(f"| `{rule}` |")]
        assert _cells(row)[4] == "`adaptive_lr`, `notify`"
    text = "\n".join(p.read_text(encoding="utf-8") for p in [ROOT / "README.md", *PAGES])
    assert "loss NaN → pause" not in text and "LR x0.5 + notify" not in text


def test_every_built_in_rule_has_a_section_in_operating() -> None:
    text = (DOCS / "operating.md").read_text(encoding="utf-8")
    headings = re.findall(r"^### `([a-z0-9_]+)`$", text, re.M)
    assert headings == [r["name"] for r in yaml.safe_load(default_rules_text())["rules"]]
    for section in re.split(r"^### ", text, flags=re.M)[1:]:
        for part in ("**What it means.**", "**What trainguard already did.**", "**What to do.**"):
            assert part in section, section.splitlines()[0]


def test_every_catalogued_metric_is_in_the_metric_reference() -> None:
    reference = _block("metrics.md", "metrics")
    rows = {_cells(r)[0].strip("`") for r in reference.splitlines() if r.startswith("| `trainguard_")}
    assert rows == {m.name for m in AGENT_METRICS} | {m.name for m in CONTROLLER_METRICS}


def _help_commands() -> list[str]:
    out = subprocess.run([sys.executable, "-c", "import sys; from trainguard.cli import main; sys.exit(main(['--help']))"],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    (choices,) = set(re.findall(r"\{([a-z0-9,-]+)\}", out.stdout))
    return choices.split(",")


def test_cli_commands_listed_are_the_ones_trainguard_help_lists() -> None:
    text = (DOCS / "controller.md").read_text(encoding="utf-8")
    section = text.split("## The command line", 1)[1].split("\n## ", 1)[0]
    listed = re.findall(r"^\| `trainguard ([a-z0-9-]+)", section, re.M)
    assert sorted(listed) == sorted(_help_commands())
    assert len(listed) == len(set(listed))


_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)
    return {_slug(h) for h in re.findall(r"^#+ (.+)$", text, re.M)}


@pytest.mark.parametrize("page", [ROOT / "README.md", *PAGES], ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    broken = []
    for target in _LINK.findall(text):
        if re.match(r"[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        path = (page.parent / file).resolve() if file else page
        if not path.exists():
            broken.append(target)
        elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
            broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)}: links that do not resolve: {broken}"


def test_readme_is_short_and_starts_with_the_two_commands() -> None:
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 200
    assert lines[0] == "# trainguard" and tuple(lines[2:4]) == COMMANDS


def test_the_docs_slug_rule_matches_githubs() -> None:
    assert _slug("An alert fired — what now") == "an-alert-fired--what-now"
    assert _slug("The LR in the frameworks' logs") == "the-lr-in-the-frameworks-logs"
    assert _slug("`loss_nonfinite`") == "loss_nonfinite"


def _prose(*pages: str) -> str:
    """The pages' text with line breaks as spaces (a statement may wrap)."""
    return " ".join(" ".join((ROOT / p).read_text(encoding="utf-8").split()) for p in pages)


def test_defaults_stated_in_prose_are_the_codes() -> None:
    import trainer_agent as ta
    from trainer_agent.control.spike_guard import SpikeGuardConfig
    from trainguard.protocol.wire import LR_SCALE_MAX, LR_SCALE_MIN
    from trainguard.service.rules import RecoveryPolicy

    guard, agent, recovery = SpikeGuardConfig(), ta.AgentConfig(), RecoveryPolicy()
    assert ta.AgentConfig.__dataclass_fields__["metrics_port"].default == 9400
    assert ta.AgentConfig.__dataclass_fields__["layer_depth"].default is None  # repeated blocks, see attach.md
    rules, attach, controller = _prose("docs/rules.md"), _prose("docs/attach.md"), _prose("docs/controller.md")
    assert (f"median + {guard.sigmas:g} robust sigmas and {guard.min_ratio:g}x the median over the last "
            f"{guard.window} steps taken") in rules
    assert f"After {guard.max_consecutive} skips in a row" in rules
    assert f"(at most {guard.min_jump:g}x the largest norm of the 3 steps taken before it:" in rules
    assert (f"(one the last {guard.min_history} steps taken rose to and came back from {guard.recurring} "
            "times or more:") in rules
    assert f"({recovery.window_reports} and {recovery.window_steps} by default)" in rules
    assert f"(`AgentConfig.memory_trace_steps`, {agent.memory_trace_steps})" in attach
    assert f"stays in [{LR_SCALE_MIN:.0e}, {LR_SCALE_MAX:.0e}]".replace("e-04", "e-4").replace("e+06", "e6") in controller
    assert "(port 9400 + local rank)" in _prose("README.md")


#: Where a ``TRAINGUARD_*`` variable the docs name may be read, besides the controller's settings:
#: the code, the deployment files and the test suite (the console's screenshots).
_READERS = ("trainer_agent", "trainguard", "service", "dashboards", "deploy", "scripts", "tests",
            "docker-compose.yml", "docker-compose.postgres.yml", ".env.example", "Dockerfile")


def _env_names(text: str) -> set[str]:
    return set(re.findall(r"\bTRAINGUARD_[A-Z0-9_]*[A-Z0-9]\b", text))


def test_every_controller_setting_is_documented_and_every_documented_variable_is_read() -> None:
    """A user sets the controller's environment from the docs: each setting's variable is named in
    them, and each ``TRAINGUARD_*`` variable they name is one something reads."""
    from trainguard.service.config import Settings

    settings = {f"TRAINGUARD_{name.upper()}" for name in Settings.model_fields}
    documented = _env_names(" ".join(p.read_text(encoding="utf-8") for p in [ROOT / "README.md", *PAGES]))
    assert sorted(settings - documented) == [], "controller settings no page names"
    read = set()
    for name in _READERS:
        for path in [ROOT / name] if (ROOT / name).is_file() else sorted((ROOT / name).rglob("*")):
            if path.is_file() and path.suffix in ("", ".py", ".sh", ".yml", ".yaml", ".example", ".tpl", ".txt"):
                read |= _env_names(path.read_text(encoding="utf-8", errors="replace"))
    assert sorted(documented - settings - read) == [], "variables the docs name that nothing reads"


def test_every_agent_setting_is_named_in_the_docs() -> None:
    """A user configures the agent from the docs: each field of ``AgentConfig`` is named in them,
    so a setting such as the device's peak FLOPs is found without reading the source."""
    import dataclasses

    import trainer_agent as ta

    text = " ".join(p.read_text(encoding="utf-8") for p in [ROOT / "README.md", *PAGES])
    named = set(re.findall(r"[a-z][a-z0-9_]*", text))
    fields = [f.name for f in dataclasses.fields(ta.AgentConfig)]
    assert len(fields) > 20
    assert sorted(set(fields) - named) == [], "AgentConfig fields no page names"


def test_a_static_agent_token_binds_to_the_first_run_it_registers(tmp_path) -> None:
    """What the README says about agent tokens, against a real controller app."""
    from fastapi.testclient import TestClient

    from trainguard.service.app import create_app
    from trainguard.service.config import Settings

    assert "binds to the first run it registers; a second run registering with it is refused (403" in _prose("README.md")
    token = "agent-token-docs-1"
    app = create_app(Settings(db=tmp_path / "tg.db", agent_tokens=(token,), operator_tokens=("operator-token-docs",)))
    body = {"job": "llm-7b", "world_size": 1, "agent_version": "test",
            "ranks": [{"rank": 0, "local_rank": 0, "host": "127.0.0.1", "port": 9400}]}
    headers = {"Authorization": f"Bearer {token}"}
    with TestClient(app) as client:
        assert client.post("/v1/runs", json={**body, "run": "llm-7b-0001"}, headers=headers).status_code == 200
        second = client.post("/v1/runs", json={**body, "run": "llm-7b-0002"}, headers=headers)
        assert client.post("/v1/runs", json={**body, "run": "llm-7b-0001"}, headers=headers).status_code == 200
    assert second.status_code == 403
    assert "this agent token is bound to run 'llm-7b-0001', not 'llm-7b-0002'" in second.text


#: An extra that is only a part: the extras it is used with (the controller's store needs the controller).
_EXTRA_NEEDS = {"postgres": "service", "hf": "agent", "lightning": "agent", "gpu": "agent"}


def test_every_extra_is_in_install_and_every_pip_install_names_extras_that_run() -> None:
    import tomllib

    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["optional-dependencies"])
    listed = {page: re.findall(r"pip install 'trainguard\[([a-z,]+)\]'", page.read_text(encoding="utf-8"))
              for page in [ROOT / "README.md", *PAGES]}
    in_install = {e for s in listed[DOCS / "install.md"] for e in s.split(",")}
    assert in_install == extras - {"dev"}, "docs/install.md lists an extra that does not exist, or misses one"
    for page, sets in listed.items():
        for names in map(lambda s: set(s.split(",")), sets):
            assert names <= extras, (page.name, names - extras)
            for name, needs in _EXTRA_NEEDS.items():
                assert name not in names or needs in names, f"{page.name}: [{','.join(sorted(names))}] lacks {needs!r}"


def _shell_code(page: Path) -> str:
    """A page's shell: its ```sh/bash blocks and its indented blocks (not those inside other fences)."""
    text = page.read_text(encoding="utf-8")
    fenced = re.findall(r"```(?:sh|bash|console)\n(.*?)```", text, re.S)
    outside = re.sub(r"```.*?```", "", text, flags=re.S)
    return "\n".join([*fenced, *(line[4:] for line in outside.splitlines() if line.startswith("    "))])


def test_every_shell_variable_a_page_uses_is_set_on_it_or_by_the_readme() -> None:
    readme = set(re.findall(r"(?:^|\s)(?:export\s+)?([A-Za-z_]\w*)=", _shell_code(ROOT / "README.md"), re.M))
    for page in [ROOT / "README.md", *PAGES]:
        code = _shell_code(page)
        used = set(re.findall(r"\$\{?([A-Za-z_]\w*)", code))
        assigned = set(re.findall(r"(?:^|\s)(?:export\s+)?([A-Za-z_]\w*)=", code, re.M))
        assert used <= assigned | readme, f"{page.name}: {sorted(used - assigned - readme)} set nowhere a reader follows"


def test_docker_compose_commands_name_the_stacks_services_and_their_files() -> None:
    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text(encoding="utf-8"))["services"]
    text = " ".join(p.read_text(encoding="utf-8") for p in [ROOT / "README.md", *PAGES])
    calls = re.findall(r"docker compose (exec|logs|run)((?: --?[a-zA-Z]+(?: \S+=\S+)?)*) ([a-z-]+)(?: (cat \S+))?", text)
    assert calls
    for verb, _, service, cat in calls:
        assert service in services, (verb, service)
        if cat:
            mounts = [v.split(":")[1] for v in services[service].get("volumes", []) if isinstance(v, str)]
            assert any(cat[4:].startswith(m.rstrip("/") + "/") for m in mounts), (service, cat, mounts)
    for name in re.findall(r"`cp (\S+) ", text):
        assert (ROOT / name).exists(), name


def test_demo_page_lists_the_demos_options_and_its_summary_as_printed() -> None:
    out = subprocess.run([sys.executable, "-m", "trainguard.cli", "demo", "--help"], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    options = set(re.findall(r"^  (--[a-z-]+)", out.stdout, re.M)) - {"--help"}
    page = (DOCS / "demo.md").read_text(encoding="utf-8")
    stated = " ".join(page.split("Options:", 1)[1].split(". If an incident", 1)[0].split())
    assert set(re.findall(r"`(--[a-z-]+)", stated)) == options
    # the example summary: its headings are the ones the demo prints, its actors built-in rules
    example = page.split("\n    actions (changes of desired state):", 1)[1].split("\n\n", 1)[0]
    printed = (ROOT / "trainguard" / "demo" / "run.py").read_text(encoding="utf-8")
    for heading in ["actions (changes of desired state):", *re.findall(r"^    (\w[^\n]*:)$", example, re.M)]:
        assert f'"{heading}"' in printed, heading
    rules = {r["name"] for r in yaml.safe_load(default_rules_text())["rules"]}
    assert set(re.findall(r"rule:(\w+)", example)) <= rules


def test_the_preflight_table_in_attach_is_laid_out_as_the_command_prints_it() -> None:
    import torch

    import trainer_agent as ta

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    agent = ta.attach(model, optimizer, job="docs", run="docs-preflight", config=ta.AgentConfig(metrics_port=None))
    try:
        report = agent.preflight({"x": torch.ones(2, 4)}, loss_fn=lambda m, b: m(b["x"]).sum())
    finally:
        agent.close()
    header, *_ = report.table().splitlines()
    width = header.index("STATUS") - 2
    block = (DOCS / "attach.md").read_text(encoding="utf-8").split("```bash\ntrainguard preflight ", 1)[1].split("```")[0]
    rows = [line[2:] for line in block.splitlines() if line.startswith("# ") and line != "# ..."]
    assert rows[0] == header
    for row in rows[1:]:
        name, status, detail = row.split(maxsplit=2)
        assert row == f"{name:<{width}}  {status:<6}  {detail}", row


def test_every_image_an_example_runs_is_built_by_a_command_the_docs_give() -> None:
    built = set(re.findall(r"docker build --target \w+\s+-t (\S+) \.", _prose("docs/kubernetes.md")))
    for example in sorted((ROOT / "deploy" / "examples").glob("*.yaml")):
        text = example.read_text(encoding="utf-8")
        header = set(re.findall(r"docker build --target \w+ -t (\S+) \.", text))
        for image in re.findall(r"^\s*image: (\S+)$", text, re.M):
            assert image in built & header, f"{example.name}: no docker build command for {image}"


def test_every_option_of_every_command_is_named_in_controller(capsys) -> None:
    """A user looks up a command's options in docs/controller.md: each option ``--help`` shows is there."""
    from trainguard import cli

    text = (DOCS / "controller.md").read_text(encoding="utf-8")
    commands = [[c] for c in _help_commands() if c not in ("demo", "preflight", "dashboards")]
    commands += [["token", "create"], ["token", "list"], ["token", "revoke"], ["rules", "check"]]
    missing = []
    for command in commands:
        with pytest.raises(SystemExit):
            cli._parser().parse_args([*command, "--help"])
        options = set(re.findall(r"^\s+(--[a-z][a-z0-9-]*)", capsys.readouterr().out, re.M)) - {"--help"}
        missing += [f"{' '.join(command)} {o}" for o in sorted(options) if f"`{o}" not in text and f" {o}" not in text]
    assert not missing, f"options docs/controller.md does not name: {missing}"


#: The commands that hand their arguments to a program of their own (checked on their pages' own terms).
_HANDING_ON = ("demo", "preflight", "dashboards")


def test_every_command_line_in_the_pages_parses(capsys) -> None:
    """Each ``trainguard ...`` line of the pages' shell code (also after ``kubectl exec ... --``)
    is one the CLI takes: its command, options and arguments, a placeholder such as RUN as a value."""
    from trainguard import cli

    parser, refused, lines = cli._parser(), [], 0
    for page in [ROOT / "README.md", *PAGES]:
        code = _shell_code(page).replace("\\\n", " ")
        for line in re.findall(r"(?:^\s*(?:\.venv/bin/)?|\s--\s+)trainguard\s+([a-z][^\n#|&;`]*)", code, re.M):
            argv = shlex.split(line)
            if argv[0] in _HANDING_ON:
                continue
            lines += 1
            try:
                parser.parse_args(argv)
            except SystemExit:
                refused.append(f"{page.name}: trainguard {line.strip()}: {capsys.readouterr().err.strip().splitlines()[-1]}")
    assert lines >= 10 and refused == []


def test_python_examples_pass_only_keywords_that_exist() -> None:
    """``attach(...)``, ``AgentConfig(...)`` and the agent's methods in the pages' Python blocks."""
    import ast
    import dataclasses
    import inspect
    import textwrap

    import trainer_agent as ta
    from trainer_agent.agent import Agent

    accepted = {name: set(inspect.signature(fn).parameters) for name, fn in inspect.getmembers(Agent, inspect.isfunction)}
    accepted |= {"attach": set(inspect.signature(ta.attach).parameters),
                 "AgentConfig": {f.name for f in dataclasses.fields(ta.AgentConfig)}}
    unknown = []
    for page in [ROOT / "README.md", *PAGES]:
        for block in re.findall(r"```python\n(.*?)```", page.read_text(encoding="utf-8"), re.S):
            for call in (n for n in ast.walk(ast.parse(textwrap.dedent(block))) if isinstance(n, ast.Call)):
                name = call.func.attr if isinstance(call.func, ast.Attribute) else getattr(call.func, "id", None)
                if name in accepted and "kwargs" not in accepted[name]:
                    unknown += [f"{page.name}: {name}({k.arg}=)" for k in call.keywords if k.arg not in accepted[name]]
    assert not unknown


def test_the_helm_install_commands_in_kubernetes_render() -> None:
    """Each ``helm install`` of docs/kubernetes.md, its --set flags as Helm reads them, rendered by Helm's
    engine (which checks the chart's values schema): the controller, and no monitoring object when off."""
    import helm_python

    text = (DOCS / "kubernetes.md").read_text(encoding="utf-8").replace("\\\n", " ")
    installs = [re.findall(r"--set '?([^' ]+)'?", line) for line in re.findall(r"^helm install .*$", text, re.M)]
    assert len(installs) == 2
    chart = helm_python.Chart.load(ROOT / "deploy" / "helm" / "trainguard")
    for sets in installs:
        rendered = chart.render(helm_python.parse_set_string(",".join(sets)), name="trainguard", namespace="trainguard",
                                is_install=True)
        kinds = {o["kind"] for p, t in rendered.items() if p.endswith(".yaml") for o in yaml.safe_load_all(t) if o}
        monitoring = {"ServiceMonitor", "PodMonitor", "PrometheusRule", "AlertmanagerConfig"}
        assert "Deployment" in kinds and (kinds & monitoring == set()) == ("serviceMonitor.enabled=false" in sets)
