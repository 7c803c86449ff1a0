"""Observation: the dispatcher's Prometheus metrics (`metrics.py`, a registry of its own)
and the dashboard's data (`dashboard.py`, `QueueWatch`). Serving them is `dispatcher.api`'s.
"""
