"""Long-running processes: the lock manager (and, later, the node agent)."""
