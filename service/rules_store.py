"""The active rules: validated as they come in (``PUT /v1/rules``, the ``--rules`` file at start-up
and on SIGHUP, a simulation's), each accepted version stored with who sent it."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable

from trainguard.service import statements as sql
from trainguard.service.config import Settings
from trainguard.service.rules import RuleSet, RulesError, default_rules_text, load_rules, require_rules
from trainguard.service.startup import load_rules_state
from trainguard.service.store import Store

__all__ = ["RulesStore"]

log = logging.getLogger("trainguard.controller")


class RulesStore:
    """The active :class:`~service.rules.RuleSet` (``active``) and its metadata (``meta``)."""

    def __init__(self, settings: Settings, store: Store, clock: Callable[[], float]) -> None:
        self.settings = settings
        self.store = store
        self.clock = clock
        self.active: RuleSet = load_rules(default_rules_text())
        self.meta: dict[str, Any] = {"version": 0, "source": "default", "actor": "", "created_at": None}

    def load(self) -> None:
        """The rules in force at start-up (:func:`service.startup.load_rules_state`)."""
        loaded = load_rules_state(self.store, self.settings, self.clock, self.validate)
        if loaded is not None:
            self.active, self.meta = loaded

    def kind_of(self, job: str, name: str) -> str:
        for r in self.active.for_job(job):
            if r.name == name:
                return r.kind
        return "unknown"

    def validate(self, text: str, *, stored: bool = False) -> RuleSet:
        """Rules that come in (``PUT /v1/rules``, the ``--rules`` file, a simulation's) must read
        only what reports carry (``service/rule_names.py``). ``stored``: rules accepted before that
        check load as they are, each such name logged."""
        limits = dict(max_reports=self.settings.window_reports, max_rank_reports=self.settings.rank_window_reports)
        try:
            return load_rules(text, **limits, check_names=True)
        except RulesError as e:
            if not stored:
                raise
            rules = load_rules(text, **limits)  # RulesError: invalid anyway
            log.warning("the stored rules read names no report carries, so these rules never fire: %s", "; ".join(e.reasons))
            return rules

    async def put(self, text: str, actor: str, *, remove_all: bool = False) -> dict[str, Any]:
        """Replace the rules. Parsing and validation run in a worker thread (a large file takes a
        while and reports keep flowing meanwhile); a file without rules is refused unless it says
        ``rules: []`` and ``remove_all`` confirms it (:func:`service.rules.require_rules`)."""
        rules = await asyncio.to_thread(self.validate, text)  # RulesError -> 422 with the reasons; old rules stay
        require_rules(rules, remove_all=remove_all)
        now = self.clock()
        vid = await self.store.submit(lambda c: sql.insert_rules_version(c, text, "api", actor, now))
        self.active = rules
        self.meta = {"version": vid, "source": "api", "actor": actor, "created_at": now}
        return self.meta

    def reload_file(self) -> bool:
        """Re-read the ``--rules`` file (SIGHUP). An unreadable or invalid file is logged and the
        active rules stay, as does a file without a ``rules`` list (empty: e.g. read while an editor
        rewrites it), which would remove every rule; the file's own ``rules: []`` removes them, as
        the operator wrote it (:func:`require_rules`). Returns whether new rules apply."""
        path = self.settings.rules
        if path is None:
            log.warning("SIGHUP: no rules file was given (--rules); nothing to reload")
            return False
        try:
            text = path.read_text(encoding="utf-8")
            rules = self.validate(text)
            require_rules(rules, remove_all=True, source="file")
        except (OSError, UnicodeDecodeError) as e:
            log.error("SIGHUP: cannot read %s, the active rules stay: %s", path, e)
            return False
        except RulesError as e:
            log.error("SIGHUP: %s is invalid, the active rules stay: %s", path, "; ".join(e.reasons))
            return False
        now = self.clock()
        source = f"file:{path}"

        def stored(fut: asyncio.Future[int]) -> None:
            if fut.cancelled() or fut.exception() is not None:
                log.error("SIGHUP: the new rules apply but could not be recorded: %r", None if fut.cancelled() else fut.exception())
                return
            self.meta = {"version": fut.result(), "source": source, "actor": "sighup", "created_at": now}

        self.active = rules
        self.meta = {"version": self.meta.get("version", 0), "source": source, "actor": "sighup", "created_at": now}
        self.store.submit(lambda c: sql.insert_rules_version(c, text, source, "sighup", now)).add_done_callback(stored)
        log.warning("SIGHUP: rules reloaded from %s (%d rules)", path, len(rules.base))
        return True
