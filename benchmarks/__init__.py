"""statefulremat's benchmark suite: ``python -m benchmarks [--quick] [--out DIR]``."""
