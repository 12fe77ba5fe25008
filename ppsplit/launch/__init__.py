"""One process per rank: dispatch, locally from a fork server or to SLURM through submitit, the
driver's channel to its ranks, a rank's entry point, and signals. May import: everything below
``report`` and ``app``."""
