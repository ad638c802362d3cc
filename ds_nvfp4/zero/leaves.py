"""ZeRO-3 leaf modules for MoE experts: their per-expert loop calls submodules a data-dependent number of times.

ZeRO-3 hooks every submodule and records the order in which modules run to prefetch their parameters; ranks must
agree on that trace (``PartitionedParameterCoordinator.reset_step`` checks it collectively). An experts module runs
its activation submodule once per expert that received tokens, which differs between batches and between ranks,
and the ranks then wait on each other's collectives forever (seen here: a 2-rank MoE run hung in its first
evaluation). DeepSpeed's answer is a leaf module (``deepspeed.utils.set_z3_leaf_module``): no hooks below it, all
its parameters gathered when it is entered. DeepSpeed's own default leaf list
(``zero_optimization.leaf_module``) names only the Mixtral, Qwen2-MoE and Qwen3-MoE sparse blocks; this marks every
experts module nn/moe.py finds by what it is, converted or kept BF16, whatever its family: the experts module that
holds expert weights, or the MoE block that loops over a list of per-expert modules.
"""

from __future__ import annotations

from torch import nn

from ..nn.moe import find_moe


def mark_experts_leaves(model: nn.Module) -> list[str]:
    """Flag each experts module of ``model`` as a ZeRO-3 leaf (before ``deepspeed.initialize``); returns the names
    of the modules newly flagged (those already leaves, or under a leaf, are left alone)."""
    from deepspeed.utils import set_z3_leaf_module, z3_leaf_module

    marked = []
    under_leaf: list[str] = []
    leaves = {s.leaf for s in find_moe(model).sites}
    for name, m in model.named_modules():
        if z3_leaf_module(m):
            under_leaf.append(f"{name}.")
            continue
        if any(name.startswith(p) for p in under_leaf) or name not in leaves:
            continue
        set_z3_leaf_module(m, True)
        under_leaf.append(f"{name}.")
        marked.append(name)
    return marked
