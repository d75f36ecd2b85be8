"""Shared helpers of the test suite, imported as ``helpers.<module>``: pytest puts tests/ on the path
(``pythonpath`` in pyproject.toml), and the fuzz worker is started with it."""
