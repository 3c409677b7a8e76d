"""Files the Slurm job writer renders: the job's bash body."""
