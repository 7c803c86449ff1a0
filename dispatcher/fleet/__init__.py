"""fairq: dispatcher/fleet."""
