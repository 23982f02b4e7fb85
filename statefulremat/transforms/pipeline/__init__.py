"""sr.pipeline: see README.md."""
