"""What a user watches and is paged on: the Grafana dashboards and the Prometheus rules.

Both are built here from the series the engine and the operator export
(`distserve_engine.metrics`, the operator's replan and phase series) and written to
`dashboards/*.json` and `charts/distserve/files/` by `scripts/gen_monitoring.py`; tests
fail when the files drift from this source. `promql` holds the names and expressions
shared by the two, `rules` the recording and alerting rules, `dashboards` the three
dashboards (built with `grafana-foundation-sdk`, a `dev` dependency: nothing at run
time imports them).
"""
