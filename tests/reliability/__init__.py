"""Reliability harnesses: SIGKILL crash campaigns, LD_PRELOAD fault injection, soak scripts.

The modules here are helpers, not tests; the tests that drive them are
`tests/test_reliability_*.py`. Scripts meant to run in a child process are started as
`python -m tests.reliability.<name>` from the repository root.
"""
