"""The `graphopt` command (main.py) and its option types (args.py)."""
