"""Intake: the requests stream read through a few shard consumers.

`shards.py` keeps each tenant's waiting requests within a window and moves a flooding
tenant's excess aside (`park.py`); `pulls.py` keeps standing pull requests on the
consumers; `arrivals.py` hands what arrived to admission in batches, one tenant at a
time round-robin.
"""
