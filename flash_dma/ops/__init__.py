"""One folder per op: its Triton kernels, autograd interface and PyTorch reference."""
