"""A real two-node Slurm cluster on this one machine, for tests (see cluster.py)."""
