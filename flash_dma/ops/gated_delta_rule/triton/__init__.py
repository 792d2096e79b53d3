"""The Triton backend of the gated delta rule: one file per kernel pass, its launcher beside it."""
