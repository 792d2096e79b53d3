"""Pieces every op shares at run time: device facts (hardware), argument checks (validation),
per-tensor plan caches (tensor_cache), kernel launches (launch), TMA descriptors (tma), launch
configuration with its overrides (config), the tuning cache (tuning_cache), the profiling log of
launch choices (profile), first-order-only autograd (autograd) and Triton math helpers
(triton_math)."""
