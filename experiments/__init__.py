"""Acceptance-rate A/B experiments between drafters on live traffic.

`record.py` is the one data contract: every request an experiment assigns ends as one
`RequestRecord`, appended to SQLite (`store.py`) and summarized by `stats.py`.
"""
