"""The files here are read by pyright (tests/test_types.py), not run by pytest."""

collect_ignore = ["user_script.py", "reveal_types.py"]
