"""``python -m tokenbudget.server``: the ``server`` command (see server/entrypoints/cli.py)."""

from tokenbudget.server.entrypoints.cli import main

main()
