"""The simulator: the real scheduling core driven by a trace on a virtual clock.

`simulator.py` runs it, `clients.py` are closed-loop clients, `replicas.py` the replicas
over their lives and the autoscaler, `trace.py` a trace record, `fairness.py` the
fairness and latency metrics. Pure like the core, and imported by nothing the service
runs (tests/test_layers.py): `fairq sim` and the benchmarks use it.
"""
