"""Token budgets and who changes them: the CUDA-OOM back-off and the NVML batch controller."""
