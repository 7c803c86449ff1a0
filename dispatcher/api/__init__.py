"""fairq: dispatcher/api."""
