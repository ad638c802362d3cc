"""FP4 GEMM backends behind one interface (`GemmBackend.mm`), and the per-run choice among them.

Each backend registers itself in its own file (kernels/registry.py); importing this package imports them all.
"""

from . import emulated, torch_native, transformer_engine  # noqa: F401 (each registers its backend)
from .base import GemmBackend, Operand, global_alpha
from .device import DeviceInfo, fp4_tensor_cores, read_device
from .operand import OperandChoice, cpu_bf16_units, operand_choice
from .registry import BackendSpec, register
from .select import BackendUnavailable, Selection, availability, decide, get_backend, select

__all__ = ["BackendSpec", "BackendUnavailable", "DeviceInfo", "GemmBackend", "Operand", "OperandChoice", "Selection",
           "availability", "cpu_bf16_units", "decide", "fp4_tensor_cores", "get_backend", "global_alpha",
           "operand_choice", "read_device", "register", "select"]
