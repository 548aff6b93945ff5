"""Model factories Libra owns (tiny local models for CPU runs and tests)."""
