"""The scheduling core: pure, synchronous and clock-free (every method takes `now`; no
asyncio, nats, redis or vllm, checked by tests/test_layers.py).

`scheduler.py` composes the stages (limits -> tiers -> DRR -> priority) over one
`EndpointQueues` per endpoint (`endpoint.py`); `queues.py` orders a tenant's requests,
`flow.py` is a tenant's flow, `policies/` decides which flow goes next, `pool.py` is what
the dispatcher knows of its workers, `placement.py` where each request goes, `limits.py`
the rate-limit and quota arithmetic, `reconfigure.py` a reload, `view.py` the read-only
queries. Only what the service runs lives here; the simulator is `dispatcher.sim`.
"""
