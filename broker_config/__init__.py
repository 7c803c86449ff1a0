"""fairq: broker_config, the broker contract. Imports nothing from the other fairq packages.

- subjects: subject builders and parsers, headers, stream/bucket/consumer names
- wire: msgspec Structs for every message, codecs, request validation
- streams: JetStream stream, bucket and consumer specs; idempotent `provision`
- server: embedded nats-server and redis-server processes
- auth: per-tenant NATS users rendered into server config
"""
