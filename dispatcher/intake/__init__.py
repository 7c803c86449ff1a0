"""fairq: dispatcher/intake."""
