"""`draftopd serve`: vLLM's OpenAI-compatible server recording its traffic (from vLLM's per-request metrics, or
with the recording hook), and a drafter that learns from the traffic it serves.

The map: `settings.py` (the flags), `server.py` (vLLM's app and engine, draftopd's routes and gauges),
`session.py` (versions serving, swaps, the recording task, live tau, MLflow), `tap.py` (stock records read from
the responses), `records.py` (finished requests'
records -> trajectories, domains, live tau), `traffic.py` (the bounded replay buffer), `learner.py` (Draft-OPD on
that buffer in a thread), `guard.py` (a candidate against the serving drafter on held-out traffic),
`versions.py` (promoted versions on disk, for rollback and restart).
"""
