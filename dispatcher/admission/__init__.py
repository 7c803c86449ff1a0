"""Admission: what intake hands over becomes queued requests or final errors.

`admit.py` parses each message against the wire contract, drops duplicates, answers a
request that already has a stored result, adopts one a worker already runs, and sends
the rest through the core's checks, the limiter store and the scheduler's queue. The
limiter stores (`redis_store.py`: Redis or in process; `kv_store.py`: monthly usage in a
NATS KV bucket) run the arithmetic of `dispatcher.core.limits`. `tokens.py` counts input
tokens with an endpoint's tokenizer. A refusal is a core `Decision`, ended by
`dispatch.endings`.
"""
