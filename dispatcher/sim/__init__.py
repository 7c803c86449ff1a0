"""fairq: dispatcher/sim."""
