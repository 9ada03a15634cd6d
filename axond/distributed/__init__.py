"""Process groups, collectives and their backends (the data plane)."""
