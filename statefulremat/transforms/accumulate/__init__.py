"""sr.accumulate: see README.md."""
