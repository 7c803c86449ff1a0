"""The fleet: what the dispatcher learns and decides about its workers beyond placement.

`probes.py` sends black-box health probes and evicts a worker that fails them;
`autoscale.py` feeds the offered load to the autoscaling policy and publishes its
decisions; `drift.py` says whether an endpoint's cost profile still matches what its
workers do.
"""
