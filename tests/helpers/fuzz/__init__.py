"""The fuzz suite's machinery: hypothesis settings, the crash-isolated worker and the cases it runs."""
