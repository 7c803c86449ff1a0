"""fairq: dispatcher/admission."""
