"""benchmark_kernels.py's measuring and reporting (timing) and its table of kernels (specs): beside the training
library, used by that script and its tests only."""
