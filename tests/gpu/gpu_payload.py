"""A node payload for tests/gpu/test_gpu_slurm.py (no torch): print the GPUs a rank of this node would see."""
import os

print(f"gpu_payload: CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')} "
      f"SLURM_GPUS_ON_NODE={os.environ.get('SLURM_GPUS_ON_NODE')}", flush=True)
