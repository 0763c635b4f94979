"""tokenbudget.worker: model execution (torch)."""
