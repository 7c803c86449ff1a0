"""fairq: producers."""
