"""Files the launch stage renders: the Slurm job's bash body."""
