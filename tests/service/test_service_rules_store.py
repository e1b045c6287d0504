"""``RulesStore.reload_file`` (SIGHUP): the ``--rules`` file applies when it is valid and says what
it means; an empty file (one read while an editor rewrites it) or one without a ``rules`` list
would remove every rule and is refused, the active rules staying, while the file's own
``rules: []`` removes them (the operator wrote it)."""

from __future__ import annotations

import concurrent.futures
from pathlib import Path

import pytest

from service.config import Settings
from service.rules import default_rules_text, load_rules
from service.rules_store import RulesStore


class _Store:
    """Records what reload_file submits; the write succeeds at once."""

    def __init__(self) -> None:
        self.submitted = 0

    def submit(self, fn) -> concurrent.futures.Future:
        self.submitted += 1
        done: concurrent.futures.Future = concurrent.futures.Future()
        done.set_result(self.submitted)
        return done


@pytest.mark.parametrize("text", ["", "\n# nothing yet\n", "defaults: {}\n"])
def test_a_file_without_a_rules_list_keeps_the_active_rules(tmp_path: Path, text: str) -> None:
    path = tmp_path / "rules.yaml"
    path.write_text(text)
    store = _Store()
    rules = RulesStore(Settings(rules=path), store, clock=lambda: 0.0)
    before = rules.active
    assert len(before.base) == len(load_rules(default_rules_text()).base) > 0
    assert rules.reload_file() is False
    assert rules.active is before and store.submitted == 0


def test_the_files_own_empty_list_and_a_valid_file_apply(tmp_path: Path) -> None:
    path = tmp_path / "rules.yaml"
    store = _Store()
    rules = RulesStore(Settings(rules=path), store, clock=lambda: 0.0)
    path.write_text("rules: []\n")
    assert rules.reload_file() is True
    assert len(rules.active.base) == 0 and store.submitted == 1
    path.write_text(default_rules_text())
    assert rules.reload_file() is True
    assert len(rules.active.base) == len(load_rules(default_rules_text()).base)
    assert rules.meta["actor"] == "sighup" and rules.meta["version"] == 2
