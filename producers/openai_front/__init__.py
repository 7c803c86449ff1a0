"""An OpenAI-compatible HTTP front: `/v1/chat/completions`, `/v1/completions`,
`/v1/embeddings` and `/v1/models`, over fairq's wire like any other client.

    python -m producers.openai_front --config configs/example.toml --nats nats://...

API keys (`[front] keys`, stored hashed) name the tenant; `model` names the endpoint.
"""
