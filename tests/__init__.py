"""The test suite. Unit tests mirror the packages (``runtime/``, ``operator/``,
``localcluster/``); ``e2e/``, ``oracle/``, ``crash/`` and ``chart/`` are system tests of
their own kind; shared helpers live in ``support/``."""
