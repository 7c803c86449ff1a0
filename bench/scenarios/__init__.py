"""Benchmarks through the live stack (nats-server, the dispatcher and workers as processes,
brought up by `bench.harness.stack`). The five end-to-end scenarios that
`bench.scenarios.all` runs and `bench.scenarios.report` writes into docs/benchmarks.md are
listed in `bench.scenarios.registry`; the others (front, soak, hostile, image_burst,
affinity_vllm) are run one by one."""
