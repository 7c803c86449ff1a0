"""fairq: dispatcher/observe."""
