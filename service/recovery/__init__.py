"""The pieces of a run's recovery ladder (``service/incidents.py``'s :class:`RunRecovery` puts them
together): the incident record and its persisted form (:mod:`.incident`), the snapshots a run holds
(:mod:`.snapshots`), the newest report's reading (:mod:`.reading`), the healthy baselines
(:mod:`.baselines`), a report's health (:mod:`.health`), the cause of the newest report
(:mod:`.report_cause`), the ladder's rungs (:mod:`.ladder`), the save and restore of the state
(:mod:`.persistence`), the troubleshooting experiment's checks (:mod:`.experiment`) and the
replay guard of a rolled-back LR jump (:mod:`.replay`)."""
