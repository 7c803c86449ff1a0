"""fairq: broker_config, the broker contract. Imports nothing from the other fairq packages
but costmodel.

- subjects: subject builders and parsers, headers, stream/bucket/consumer names
- wire: the public wire contract's messages, codecs and request validation;
  wire_generation: sampling and chat parts engines use; wire_internal: batches,
  heartbeats, completions and everything else between dispatcher and workers
- config: the configuration root and loading; config_scheduling (endpoints, tiers,
  tenants, limits), config_services ([broker], [dispatcher], [workers], [front]),
  config_types; tenant_registry: each tenant's tier, weight and limits, resolved once
- streams: JetStream stream, bucket and consumer specs; idempotent `provision`
- lease_key: the dispatchers' lease and its epoch fence
- server, cluster: embedded nats-server (one node or three) and redis-server processes
- auth: per-tenant NATS users rendered into server config
"""
