"""SM90 kernels of the gated delta rule in Gluon (Triton's explicit-layout dialect): warpgroup
MMA with register operands, for passes that Triton's tl.dot cannot schedule well. GPU only (the
interpreter does not run Gluon); the plan picks them (plan.fused_forward)."""
