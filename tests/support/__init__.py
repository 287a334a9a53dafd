"""Helpers the tests share, never tests themselves (pytest collects nothing here).

The tests tree is a package (``tests.runtime.storage.test_storage_gcs`` and so on), so a test
imports what it shares with others from here by its full name (``from
tests.support.gcs_emulator import FakeGcs``): no test module imports another, and no one
edits ``sys.path``. Fixtures stay in the ``conftest.py`` nearest to the tests that use them.
The benchmarks import from here too, run as modules from the repository root
(``python -m bench.storage``).
"""
