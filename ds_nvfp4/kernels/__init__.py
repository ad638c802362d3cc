"""FP4 GEMM backends behind one interface (`GemmBackend.mm`), and the per-run choice among them."""

from .base import GemmBackend, Operand, global_alpha
from .operand import OperandChoice, cpu_bf16_units, operand_choice
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
           "cpu_bf16_units", "decide", "fp4_tensor_cores", "get_backend", "global_alpha", "operand_choice",
           "read_device", "select"]
