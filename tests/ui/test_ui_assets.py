"""The console's assets: every file under service/ui ships as package data, the vendored
libraries carry their licences, and the console's own files name no other host (no CDN)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from trainguard.service.routes.ui import UI_DIR

ROOT = Path(__file__).resolve().parents[2]


def test_every_console_file_is_package_data() -> None:
    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["trainguard.service"]
    ui = ROOT / "service" / "ui"
    assert UI_DIR.resolve() == ui.resolve()
    files = {p for p in ui.rglob("*") if p.is_file() and "__pycache__" not in p.parts}
    packaged = {p for g in globs if g.startswith("ui/") for p in (ROOT / "service").glob(g) if p.is_file()}
    assert files and files == packaged, sorted(str(p.relative_to(ui)) for p in files ^ packaged)


def test_vendored_libraries_carry_their_licences() -> None:
    for lib in ("uplot", "swagger-ui"):
        folder = UI_DIR / "vendor" / lib
        assert (folder / "LICENSE").read_text().strip() and (folder / "VERSION").read_text().strip()
    assert "MIT License" in (UI_DIR / "vendor" / "uplot" / "LICENSE").read_text()
    assert "Apache License" in (UI_DIR / "vendor" / "swagger-ui" / "LICENSE").read_text()


def test_the_console_names_no_other_host() -> None:
    own = [p for p in UI_DIR.iterdir() if p.is_file() and p.suffix in {".html", ".js", ".css", ".svg"}]
    assert {p.name for p in own} >= {"index.html", "app.js", "run.js", "charts.js", "api.js", "console.css"}
    for p in own:
        text = p.read_text()
        if p.suffix == ".svg":
            text = text.replace('xmlns="http://www.w3.org/2000/svg"', "")  # a namespace name, never fetched
        assert not re.search(r"(https?:)?//[a-z0-9.-]+\.[a-z]{2,}", text, re.I), p.name


def test_the_consoles_scripts_never_turn_text_into_markup_or_code() -> None:
    # Run, rule, node and layer names, reasons and diagnoses come from the network: they go into
    # the page as text nodes and attribute values only (dom.js's h()), so a name holding <script>
    # or quotes is shown, never run.
    sinks = re.compile(r"\.innerHTML|\.outerHTML|insertAdjacentHTML|document\.write|\beval\(|new Function\(|"
                       r"setTimeout\(\s*[\"'`]|\.srcdoc\b|javascript:")
    scripts = [p for p in UI_DIR.iterdir() if p.suffix == ".js"]
    assert {p.name for p in scripts} >= {"app.js", "run.js", "dom.js", "actions.js"}
    found = {p.name: sinks.findall(p.read_text()) for p in scripts}
    assert not any(found.values()), found
    assert "innerHTML" in (UI_DIR / "dom.js").read_text()  # (the comment naming what it never uses: the scan reads the files)
