"""``deepspeed.pipe.PipelineModule``: a ``PipelineEngine`` (ZeRO-0/1 with pipeline stages) gets the same FP4 layers
and features as a DeepSpeedEngine. Its optimizer step runs inside ``train_batch`` (lifecycle.py hooks that); each
stage holds only its own layers, named by their position in the whole layer list, so the blocks that
``precision.modules`` counts come from the module's layer specs (``_layer_specs``: a seam, zero/seams.py)."""

from __future__ import annotations

from torch import nn

from ..nn.blocks import Blocks, blocks_among


def _kind(spec) -> str:
    """The class a pipeline layer spec builds (LayerSpec / TiedLayerSpec), or the layer's own class or name."""
    typename = getattr(spec, "typename", None)
    if isinstance(typename, type):
        return typename.__name__
    if isinstance(spec, nn.Module):
        return type(spec).__name__
    return getattr(spec, "__name__", type(spec).__name__)


def pipeline_blocks(module: nn.Module) -> Blocks | None:
    """The transformer blocks of a PipelineModule (None for any other module, or when its specs are unreadable)."""
    try:
        from deepspeed.pipe import PipelineModule
    except ImportError:
        return None
    if not isinstance(module, PipelineModule):
        return None
    specs = getattr(module, "_layer_specs", None)
    return blocks_among([_kind(s) for s in specs]) if specs is not None else None


def stage_note(engine) -> str:
    """What a pipeline rank's conversion table shows."""
    return (f"pipeline stage {engine.stage_id} of {engine.num_stages}: this rank holds and converts its stage's layers "
            "only (each stage's rank 0 reports its own)")
