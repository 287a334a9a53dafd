"""Benchmarks that print JSON, run as modules from the repository root
(``python -m bench.storage``) so they import the test helpers of ``tests.support`` without
editing ``sys.path``; the runtime, operator and local cluster come from the installed
distribution (``make venv`` installs the repository in editable mode)."""
