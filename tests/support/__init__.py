"""Test support shared across tests/ folders (imported as ``support.*``: pytest puts tests/ on the
path, pyproject's ``pythonpath``). Fixture code only: no test functions, nothing of bench/."""
