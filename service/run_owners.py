"""Which agent token may act for which run: the ``TOKEN:RUN`` entries of the configuration, the
configured tokens bound to the run they registered first, and the runs registered with tokens
created at runtime (their owners), each bounded per token."""

from __future__ import annotations

import fnmatch

from trainguard.service import statements as sql
from trainguard.service.auth import Principal
from trainguard.service.errors import Forbidden, NotFound
from trainguard.service.runstate import RunState
from trainguard.service.store import Store

__all__ = ["RunOwners"]


class RunOwners:
    """The runs' owners, and the check every agent route makes (:meth:`check_agent`)."""

    def __init__(self, runs: dict[str, RunState]) -> None:
        self.runs = runs
        self.bindings: dict[str, str] = {}
        """The run each configured agent token (by digest) registered first."""
        #: Runs that configured ``TOKEN:RUN`` agent tokens own (set by the app from its TokenTable).
        self.reserved_runs: frozenset[str] = frozenset()
        #: Runs registered by each agent token (by digest): bounded by ``settings.max_runs_per_token``.
        self.token_runs: dict[str, set[str]] = {}
        #: Owner (token digest) of each run registered with a token created at runtime.
        self.owners: dict[str, str] = {}

    def load(self, store: Store) -> None:
        """Read the bindings and owners back from the database (at start-up)."""
        self.bindings = store.read_now(sql.agent_bindings)
        self.owners = store.read_now(sql.run_owners)
        for digest, run in [*self.bindings.items(), *((d, r) for r, d in self.owners.items())]:
            self.token_runs.setdefault(digest, set()).add(run)

    def check_agent(self, principal: Principal, run: str, *, registering: bool = False, job: str | None = None) -> None:
        """403 (or 404) unless ``principal`` may act as the agent of ``run`` (of ``job``, when registering).

        A run has at most one owner, whatever kind of agent token claims it: the ``TOKEN:RUN``
        entries naming it, else the token that registered it first (a configured token bound to
        it, or a token created at runtime). Registration refuses a run another token owns
        (:meth:`_claimed_by_other`), so on every later route the token's own claim suffices
        (:meth:`_check_own`). Agent routes call this before they look the run up: a token learns
        nothing of the runs it does not own, not even whether they exist."""
        if principal.kind != "agent":
            return
        if not registering:
            self._check_own(principal, run)
            return
        if run in self.reserved_runs and principal.bound_run != run:
            raise Forbidden(f"run {run!r} belongs to the agent token configured for it (TOKEN:{run} in TRAINGUARD_AGENT_TOKENS)")
        if principal.job_pattern is not None:  # a token created at runtime, for the runs of some jobs
            owner = self.owners.get(run)
            if owner == principal.token_digest:
                return
            if owner is not None:
                raise Forbidden(f"run {run!r} belongs to the token that registered it")
            if job is not None and not fnmatch.fnmatchcase(job, principal.job_pattern):
                raise Forbidden(f"this token may register runs of jobs matching {principal.job_pattern!r}, not {job!r}")
            if run in self.runs or self._claimed_by_other(run, principal.token_digest):
                raise Forbidden(f"run {run!r} belongs to another agent token")
            return
        bound = principal.bound_run or self.bindings.get(principal.token_digest)
        if bound is not None and bound != run:
            raise Forbidden(f"this agent token is bound to run {bound!r}, not {run!r}")
        if bound is None and self._claimed_by_other(run, principal.token_digest):
            raise Forbidden(f"run {run!r} belongs to another agent token; to hand it to this one, "
                            f"configure it as TOKEN:{run} in TRAINGUARD_AGENT_TOKENS")

    def _check_own(self, principal: Principal, run: str) -> None:
        """Refuse ``principal`` on a route of ``run`` it does not own, with an answer that depends
        on the token and the name only: 403 for a configured token bound to another run; 404 for a
        token that claims no such run (unbound, or created at runtime), so that its agent
        registers (again, after a controller that forgot its runs), and registration decides."""
        if principal.job_pattern is not None:
            own = self.owners.get(run) == principal.token_digest
        else:
            bound = principal.bound_run or self.bindings.get(principal.token_digest)
            if bound is not None and bound != run:
                raise Forbidden(f"this agent token is bound to run {bound!r}, not {run!r}")
            own = bound is not None
        if not own:
            raise NotFound(f"run {run!r} is not registered with this agent token: register it first (POST /v1/runs)")
        if run in self.reserved_runs and principal.bound_run != run:
            raise Forbidden(f"run {run!r} belongs to the agent token configured for it (TOKEN:{run} in TRAINGUARD_AGENT_TOKENS)")

    def _claimed_by_other(self, run: str, digest: str) -> bool:
        """Whether an agent token other than ``digest`` owns ``run`` (or is registering it)."""
        if run in self.reserved_runs:
            return True
        owner = self.owners.get(run)
        if owner is not None and owner != digest:
            return True
        return any(r == run and d != digest for d, r in self.bindings.items())
