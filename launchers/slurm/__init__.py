"""SLURM backend (submitit): launcher, sbatch rendering, the in-allocation task."""
