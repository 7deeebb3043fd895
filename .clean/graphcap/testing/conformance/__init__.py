"""The conformance checks. Collected with ``--pyargs graphcap.testing.conformance``."""
