"""sr.vmap: see README.md."""
