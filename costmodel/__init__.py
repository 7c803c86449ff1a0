"""fairq: costmodel."""
