"""Plugin ops: one folder per op, each with its Triton kernel(s) and TensorRT plugin definition."""
