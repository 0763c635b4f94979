"""``python -m tokenbudget.server``: the ``server`` command (see server/cli.py)."""
from tokenbudget.server.cli import main

main()
