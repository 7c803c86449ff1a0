"""fairq: dispatcher."""
