"""The independent-deployment baseline: how its deployments split the KV memory, and how they serve."""
