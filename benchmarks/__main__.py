"""``python -m benchmarks``: runs the whole suite (see ``benchmarks/run.py``)."""

from benchmarks.run import main

main()
