"""fairq: dispatcher/ha."""
