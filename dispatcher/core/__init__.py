"""fairq: dispatcher/core."""
