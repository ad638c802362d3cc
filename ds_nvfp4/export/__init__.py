"""Export a DeepSpeed checkpoint of an NVFP4 run for serving: BF16, ModelOpt NVFP4 or compressed-tensors NVFP4.

``units.py`` decides what each trained GEMM weight becomes (per-expert names for MoE, Conv1D layouts), ``formats.py``
the tensors and configuration files of each format, ``writer.py`` writes them atomically.
"""

from ..checkpoint.reader import load_run
from .formats import FORMATS, compressed_tensors_config, modelopt_config
from .units import ExportError, export_groups
from .writer import ExportSummary, export

__all__ = ["FORMATS", "ExportError", "ExportSummary", "compressed_tensors_config", "export", "export_groups",
           "load_run", "modelopt_config"]
