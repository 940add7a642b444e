"""orchestrate: multi-node LLM training jobs on local, SSH and SLURM clusters.

Importing this package is cheap on purpose: heavy libraries (torch, transformers, trl,
deepspeed, paramiko, submitit) are imported lazily by the modules that need them.
"""

__version__ = "0.1.0"
