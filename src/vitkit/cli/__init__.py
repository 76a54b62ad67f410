"""The `vitkit` command line: one module per group of commands, assembled in main.py."""
