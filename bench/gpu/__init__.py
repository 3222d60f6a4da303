"""bench/gpu_check.py's pieces: models.py (which model, loaded by Tandem and transformers), correctness.py, throughput.py, kernels.py."""
