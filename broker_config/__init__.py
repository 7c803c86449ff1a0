"""fairq: broker_config."""
