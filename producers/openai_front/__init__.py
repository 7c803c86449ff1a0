"""An OpenAI-compatible HTTP front: `/v1/chat/completions`, `/v1/completions`,
`/v1/embeddings`, `/v1/models` and `/v1/models/{model}`, over fairq's wire like any other
client; and `/health` (no key) for load balancers.

    python -m producers.openai_front --config configs/example.toml --nats nats://...

API keys (`[front] keys`, stored hashed) name the tenant; `model` names the endpoint.
"""
