"""Smoke test of an installed trainguard, run from outside the checkout by scripts/wheel_smoke.sh in
a fresh virtual environment that has only the extras a user picked:

    python wheel_smoke.py --extras agent,hf --readme /path/to/README.md --covered covered.txt

Checks, as far as the extras allow: the packages are imported from the environment (not from a
checkout); the license is declared and its text installed in the .dist-info; the data files the
code reads are installed (console assets, the built-in rules, the
generated dashboards, Prometheus/Alertmanager files, the promtool tests); every import statement
in the README's code blocks that the extras can satisfy runs (those it ran are appended to
``--covered``, so the caller can check every one ran somewhere); a command whose extras are not
all installed exits at once naming them; with ``agent`` a tiny model
trains two steps with the agent attached; with ``service`` ``trainguard serve`` answers /healthz
and serves the console, the API docs and their assets; with ``dashboards`` the installed
generated files equal what the installed code renders; with ``hf`` / ``lightning`` the callback
rides a two-step ``Trainer`` of a tiny model built in memory (nothing downloaded).

Exit status 0 when every check passed; the first failure raises with what was expected.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.metadata
import importlib.resources
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

#: Import prefix -> the extras that install it (longest prefix wins): trainguard's own modules and
#: the third-party packages its dependencies bring. A README import of any other package (one the
#: user installs for an example, such as a data set library) is not run: no extras set has it.
NEEDS = {
    "trainer_agent.integrations.hf": {"agent", "hf"},
    "trainer_agent.integrations.lightning": {"agent", "lightning"},
    "trainer_agent": {"agent"},
    "trainguard.service": {"service"},
    "trainguard.dashboards": {"service", "dashboards"},
    "trainguard.demo": {"agent", "service"},
    "trainguard": set(),
    "numpy": set(), "prometheus_client": set(), "pydantic": set(), "httpx": set(),
    "torch": {"agent"},
    "transformers": {"agent", "hf"}, "accelerate": {"agent", "hf"},
    "lightning": {"agent", "lightning"}, "pytorch_lightning": {"agent", "lightning"},
    "fastapi": {"service"}, "uvicorn": {"service"}, "pydantic_settings": {"service"}, "yaml": {"service"},
    "grafanalib": {"dashboards"},
}
#: The extras sets scripts/wheel_smoke.sh installs.
EXTRAS_SETS = ({"agent"}, {"service"}, {"agent", "hf"}, {"agent", "lightning"}, {"service", "dashboards"})

#: Data files the installed code reads, relative to the ``trainguard`` package.
DATA_FILES = (
    "service/default_rules.yaml",
    "service/ui/index.html", "service/ui/app.js", "service/ui/console.css", "service/ui/favicon.svg",
    "service/ui/vendor/swagger-ui/swagger-ui-bundle.js", "service/ui/vendor/swagger-ui/swagger-ui.css",
    "dashboards/generated/prometheus/prometheus.yml", "dashboards/generated/prometheus/rules.yml",
    "dashboards/generated/alertmanager/alertmanager.yml",
    "dashboards/generated/grafana/dashboards/training-stability.json",
    "dashboards/generated/grafana/provisioning/datasources/prometheus.yml",
    "dashboards/generated/grafana/provisioning/dashboards/trainguard.yml",
    "dashboards/promtool/rules_test.yml",
)


def ok(what: str) -> None:
    print(f"  ok: {what}", flush=True)


def needs(module: str) -> set[str] | None:
    """The extras ``module`` needs; None for a package that trainguard does not install."""
    for prefix in sorted(NEEDS, key=len, reverse=True):
        if module == prefix or module.startswith(prefix + "."):
            return NEEDS[prefix]
    return None


def runnable(statement: str, extras: set[str]) -> bool:
    """Whether every module ``statement`` imports is installed with ``extras`` (the standard
    library always is)."""
    for module in statement_modules(statement):
        if module.split(".")[0] in sys.stdlib_module_names:
            continue
        wanted = needs(module)
        if wanted is None or not wanted <= extras:
            return False
    return True


def expected_readme_imports(readme: Path) -> list[str]:
    """The README imports some extras set of scripts/wheel_smoke.sh can run (each must run in one)."""
    return [s for s in readme_imports(readme) if any(runnable(s, extras) for extras in EXTRAS_SETS)]


def readme_imports(readme: Path) -> list[str]:
    """The import statements in the README's code blocks (fenced or indented), one statement each,
    as written (``from a import (b,\\n c)`` joined)."""
    lines, in_fence, code = readme.read_text(encoding="utf-8").splitlines(), False, []
    for line in lines:
        if line.lstrip().startswith("```"):
            in_fence = not in_fence
            continue
        if in_fence or line.startswith("    "):
            code.append(line.strip())
    found, pending = [], ""
    for line in code:
        if pending:
            pending += " " + line
            if ")" in line:
                found.append(pending)
                pending = ""
            continue
        if re.match(r"(from\s+[\w.]+\s+import\s+|import\s+[\w.])", line):
            statement = line.split("#", 1)[0].strip()
            if statement.endswith("("):
                pending = statement
            else:
                found.append(statement)
    statements = []
    for text in found:
        tree = ast.parse(text)  # a README import that is not valid Python is itself a defect
        (node,) = tree.body
        assert isinstance(node, (ast.Import, ast.ImportFrom)), text
        statements.append(ast.unparse(node))
    return list(dict.fromkeys(statements))


def statement_modules(statement: str) -> list[str]:
    node = ast.parse(statement).body[0]
    return [node.module or ""] if isinstance(node, ast.ImportFrom) else [alias.name for alias in node.names]


def check_installed_location(extras: set[str]) -> None:
    site = Path(sysconfig.get_paths()["purelib"]).resolve()
    names = ["trainguard"] + (["trainer_agent"] if "agent" in extras else [])
    for name in names:
        module = importlib.import_module(name)
        where = Path(module.__file__).resolve()
        assert site in where.parents, f"{name} imported from {where}, not from this environment's {site}"
    ok(f"{', '.join(names)} imported from {site}")


def check_data_files() -> None:
    root = importlib.resources.files("trainguard")
    for rel in DATA_FILES:
        item = root.joinpath(*rel.split("/"))
        assert item.is_file() and item.read_bytes(), f"installed package lacks {rel}"
    for board in root.joinpath("dashboards", "generated", "grafana", "dashboards").iterdir():
        assert json.loads(board.read_text(encoding="utf-8"))["panels"], board
    ok(f"{len(DATA_FILES)} data files installed, Grafana dashboards parse")


def check_license() -> None:
    """The installed distribution declares its license (an SPDX expression) and carries the file
    that holds its text in its ``.dist-info/licenses/`` (PEP 639)."""
    dist = importlib.metadata.distribution("trainguard")
    expression, files = dist.metadata["License-Expression"], dist.metadata.get_all("License-File") or []
    assert expression == "Apache-2.0", f"License-Expression is {expression!r}, not 'Apache-2.0'"
    assert files == ["LICENSE"], f"License-File names {files}, not the LICENSE file"
    text = dist.read_text("licenses/LICENSE")
    assert text and "Apache License" in text and "Version 2.0, January 2004" in text, \
        "the .dist-info has no licenses/LICENSE holding the Apache License 2.0"
    ok(f"license {expression}, its text in .dist-info/licenses/LICENSE")


def check_readme_imports(readme: Path, extras: set[str], covered: Path | None) -> None:
    statements = readme_imports(readme)
    assert statements, f"no import statement found in {readme}'s code blocks"
    ran = []
    for statement in statements:
        if runnable(statement, extras):
            try:
                exec(compile(statement, f"<{readme.name}>", "exec"), {})
            except ImportError as e:
                raise AssertionError(f"the README's `{statement}` fails with [{','.join(sorted(extras))}] installed: {e!r}") from e
            ran.append(statement)
    if covered is not None:
        with covered.open("a", encoding="utf-8") as f:
            f.writelines(s + "\n" for s in ran)
    ok(f"{len(ran)} of the README's {len(statements)} import statements run with [{','.join(sorted(extras))}]")


def check_agent() -> None:
    import torch

    import trainer_agent as ta

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    agent = ta.attach(model, opt, job="smoke", run="smoke-0001",
                      config=ta.AgentConfig(report_every=1, metrics_port=None))
    try:
        losses = []
        for _ in range(2):
            loss = model(torch.randn(16, 4)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            agent.end_step(loss.detach())
            losses.append(float(loss))
        latest = agent.latest()
    finally:
        agent.close(timeout=5.0)
    assert agent.step == 2, agent.step
    assert math.isclose(latest["trainguard_loss"], losses[-1], rel_tol=1e-6), (latest["trainguard_loss"], losses)
    assert latest["trainguard_grad_norm"] > 0
    ok("trainer_agent.attach on a tiny model: 2 steps, the last loss reported")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> tuple[int, str, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status, resp.headers.get("content-type", ""), resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("content-type", ""), e.read()


def check_serve(workdir: Path) -> None:
    """``trainguard serve`` on a free loopback port: the banner names the console URL and says auth
    is off (no tokens); /healthz, /ui, /docs and the assets they load answer 200."""
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
    log = (workdir / "serve.log").open("w+", encoding="utf-8")
    proc = subprocess.Popen([str(Path(sys.executable).with_name("trainguard")), "serve", "--port", str(port),
                             "--db", str(workdir / "smoke.db")], stdout=log, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, f"trainguard serve exited {proc.returncode}: {(workdir / 'serve.log').read_text()}"
            try:
                status, _, body = _get(base + "/healthz")
                if status == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, f"no /healthz in 60 s: {(workdir / 'serve.log').read_text()}"
            time.sleep(0.2)
        page = {}
        for path, kind in (("/ui", "text/html"), ("/ui/static/app.js", "javascript"), ("/ui/static/console.css", "text/css"),
                           ("/docs", "text/html"), ("/ui/static/vendor/swagger-ui/swagger-ui-bundle.js", "javascript"),
                           ("/ui/static/vendor/swagger-ui/swagger-ui.css", "text/css"), ("/openapi.json", "application/json")):
            status, ctype, body = _get(base + path)
            assert status == 200 and kind in ctype and body, f"GET {path}: {status} {ctype} {body[:200]!r}"
            page[path] = body.decode("utf-8", "replace")
        assert "/ui/static/vendor/swagger-ui/swagger-ui-bundle.js" in page["/docs"]
        assert json.loads(page["/openapi.json"])["paths"]
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    log.seek(0)
    banner = log.read()
    assert f"{base}/ui" in banner, f"the banner does not name the console {base}/ui:\n{banner}"
    assert "auth is OFF" in banner, f"the banner does not say that auth is off without tokens:\n{banner}"
    ok(f"trainguard serve on port {port}: /healthz, /ui, /docs and their assets; banner names {base}/ui, auth off")
    rules = importlib.resources.files("trainguard").joinpath("service", "default_rules.yaml")
    done = subprocess.run([str(Path(sys.executable).with_name("trainguard")), "rules", "check", str(rules)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "OK" in done.stdout, done.stdout + done.stderr
    ok(f"trainguard rules check on the installed built-in rules: {done.stdout.strip().split(': ', 1)[1]}")


def check_dashboards() -> None:
    generated = importlib.resources.files("trainguard").joinpath("dashboards", "generated")
    done = subprocess.run([str(Path(sys.executable).with_name("trainguard")), "dashboards", "build", "--check",
                           "--out", str(generated)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    ok("the installed generated dashboards and rules equal what the installed code renders")
    # Without --out, an installed build writes into the current directory, never the package.
    before = sorted(p.name for p in Path(str(generated)).rglob("*"))
    done = subprocess.run([str(Path(sys.executable).with_name("trainguard")), "dashboards", "build"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert Path("trainguard-generated/prometheus/rules.yml").is_file(), done.stdout
    assert sorted(p.name for p in Path(str(generated)).rglob("*")) == before
    ok("`trainguard dashboards build` writes into ./trainguard-generated, not into the installed package")


#: A command, the extras it needs, and an import of those extras it reaches first.
COMMAND_NEEDS = ((["demo", "--steps", "1"], {"agent", "service"}), (["dashboards", "build"], {"dashboards"}),
                 (["serve", "--port", "0"], {"service"}))


def check_missing_extras(extras: set[str]) -> None:
    """Each command whose extras are not all installed exits 2 at once, naming every extra it
    needs, before it starts anything (the demo would otherwise fail in its controller)."""
    checked = []
    for argv, wanted in COMMAND_NEEDS:
        if wanted <= extras:
            continue
        done = subprocess.run([str(Path(sys.executable).with_name("trainguard")), *argv], capture_output=True,
                              text=True, timeout=60)
        hint = f"pip install 'trainguard[{','.join(sorted(wanted))}]'"
        assert done.returncode == 2 and done.stderr.strip().endswith(hint) and not done.stdout, \
            f"trainguard {' '.join(argv)} with [{','.join(sorted(extras))}]: {done.returncode} {done.stdout}{done.stderr}"
        checked.append(argv[0])
    ok(f"{', '.join(checked) or 'no command'} without their extras: exit 2, naming them")


def check_hf(workdir: Path) -> None:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    import trainer_agent as ta
    from trainer_agent.integrations.hf import TrainguardCallback

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16))
    ids = torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": row, "labels": row} for row in ids]
    callback = TrainguardCallback(job="smoke", run="smoke-hf", config=ta.AgentConfig(report_every=1, metrics_port=None))
    args = TrainingArguments(output_dir=str(workdir / "hf"), per_device_train_batch_size=2, max_steps=2,
                             logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True,
                             dataloader_num_workers=0, seed=0)
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[callback])
    trainer.train()
    logged = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    agent = callback.agent
    assert agent is not None and agent.step == 2 and len(logged) == 2, (agent, logged)
    ours = agent.latest()["trainguard_loss"]
    assert math.isclose(ours, logged[-1], rel_tol=1e-3), (ours, logged)
    ok(f"transformers.Trainer with TrainguardCallback: 2 steps, loss {ours:.4f} = the Trainer's {logged[-1]:.4f}")


def check_lightning(workdir: Path) -> None:
    import lightning.pytorch as L
    import torch

    import trainer_agent as ta
    from trainer_agent.integrations.lightning import TrainguardCallback

    class TinyModule(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(4, 1)
            self.losses: list[float] = []

        def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
            (x,) = batch
            loss = self.net(x).pow(2).mean()
            self.losses.append(float(loss))
            return loss

        def configure_optimizers(self):  # type: ignore[no-untyped-def]
            return torch.optim.SGD(self.parameters(), lr=0.1)

    torch.manual_seed(0)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 4)), batch_size=2)
    module = TinyModule()
    callback = TrainguardCallback(job="smoke", run="smoke-lightning",
                                  config=ta.AgentConfig(report_every=1, metrics_port=None))
    trainer = L.Trainer(max_steps=2, callbacks=[callback], accelerator="cpu", devices=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=str(workdir / "lightning"))
    trainer.fit(module, data)
    agent = callback.agent
    assert agent is not None and agent.step == 2 and len(module.losses) == 2, (agent, module.losses)
    ours = agent.latest()["trainguard_loss"]
    assert math.isclose(ours, module.losses[-1], rel_tol=1e-6), (ours, module.losses)
    ok(f"lightning Trainer with TrainguardCallback: 2 steps, loss {ours:.4f} = the module's")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--extras", default="", help="the extras installed, comma-separated (agent,hf)")
    parser.add_argument("--readme", type=Path, required=True, help="the README whose import statements to run")
    parser.add_argument("--covered", type=Path, default=None, help="append the README imports that ran to this file")
    parser.add_argument("--list-readme-imports", action="store_true",
                        help="print the README's import statements that some extras set can run, and exit")
    args = parser.parse_args(argv)
    if args.list_readme_imports:
        expected = expected_readme_imports(args.readme)
        for statement in readme_imports(args.readme):
            if statement not in expected:
                print(f"not run (no extras set installs it): {statement}", file=sys.stderr)
        print("\n".join(expected))
        return 0
    extras = {e for e in args.extras.split(",") if e}
    unknown = extras - {"agent", "service", "dashboards", "hf", "lightning", "gpu"}
    if unknown:
        parser.error(f"unknown extras {sorted(unknown)}")
    print(f"smoke test of trainguard [{','.join(sorted(extras))}] in {sys.prefix}", flush=True)
    with tempfile.TemporaryDirectory(prefix="trainguard-smoke-") as tmp:
        workdir = Path(tmp)
        os.chdir(workdir)
        check_installed_location(extras)
        check_data_files()
        check_license()
        check_readme_imports(args.readme, extras, args.covered)
        check_missing_extras(extras)
        if "agent" in extras:
            check_agent()
        if "service" in extras:
            check_serve(workdir)
        if {"service", "dashboards"} <= extras:
            check_dashboards()
        if {"agent", "hf"} <= extras:
            check_hf(workdir)
        if {"agent", "lightning"} <= extras:
            check_lightning(workdir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
