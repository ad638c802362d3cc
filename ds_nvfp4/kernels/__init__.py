"""FP4 GEMM backends behind one interface (`GemmBackend.mm`), and the per-run choice among them."""

from .base import GemmBackend, Operand, global_alpha
from .operand import OperandChoice, operand_choice
from .select import (
    BackendUnavailable,
    DeviceInfo,
    Selection,
    availability,
    decide,
    fp4_tensor_cores,
    get_backend,
    read_device,
    select,
)

__all__ = ["BackendUnavailable", "DeviceInfo", "GemmBackend", "Operand", "OperandChoice", "Selection", "availability",
           "decide",
           "fp4_tensor_cores", "get_backend", "global_alpha", "operand_choice", "read_device", "select"]
