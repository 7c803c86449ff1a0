"""The dispatcher's outward face: the wire contract's request/reply APIs and the one HTTP
server.

`request_reply.py` answers status, cancel and depth; `calls.py` runs those calls side by
side with a cap per tenant; `lookup.py` finds requests still in the streams; `reload.py`
applies a new config file (SIGHUP or `<prefix>.admin.reload`). `http.py` serves
/metrics, /healthz, /readyz and the dashboard: no other room serves HTTP
(tests/test_layers.py).
"""
