"""Dispatch: batches out, worker reports in, and every way a request ends.

`batches.py` fills each worker's free capacity from the scheduler and sends the batch;
`reports.py` takes heartbeats and completions (and what follows from their absence);
`endings.py` ends a request (done, error, expired, cancelled) or hands it back to the
broker, settling its charges once; `held.py` is the JetStream message held per request;
`stored_results.py` the results bucket; `convert.py` the one conversion between the
core's types and the wire's.
"""
