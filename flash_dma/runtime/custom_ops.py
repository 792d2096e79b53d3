"""What the ops' torch.library custom ops (ops/<op>/custom_op.py) share.

A custom op returns tensors only, never None: an output that a call does not produce (a final
state not asked for, a gradient not wanted) comes back as an empty placeholder and becomes None
again on the Python side.

The public functions call their custom ops only while torch.compile traces them
(use_custom_ops): there the op is one node of the graph, with fake implementations for its
shapes, so fullgraph=True and dynamic shapes work. Eagerly the ops' autograd Functions run
instead, which plan once per call and keep the plan for the backward (a custom op's backward
must re-plan from its tensors and flags).
"""
from __future__ import annotations

import torch


def use_custom_ops() -> bool:
    """True while torch.compile (Dynamo) traces the caller."""
    return torch.compiler.is_compiling()


def absent(like: torch.Tensor) -> torch.Tensor:
    """The placeholder of an output that a call does not produce."""
    return like.new_empty(0)


def present(t: torch.Tensor, produced: bool) -> torch.Tensor | None:
    """A custom op's output back as the public functions return it: None where not produced."""
    return t if produced else None
