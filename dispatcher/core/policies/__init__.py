"""fairq: dispatcher/core/policies."""
