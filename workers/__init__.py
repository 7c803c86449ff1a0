"""fairq: workers."""
