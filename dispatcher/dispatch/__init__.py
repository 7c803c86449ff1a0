"""fairq: dispatcher/dispatch."""
