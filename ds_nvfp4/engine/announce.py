"""What rank 0 tells the user: the one-line summary of an NVFP4 run, shown where the user looks."""

from __future__ import annotations

import logging
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..zero import StorageReport
    from .state import NVFP4State

log = logging.getLogger("ds_nvfp4")


def announce(text: str) -> None:
    """Say ``text`` where the user looks: through the ``ds_nvfp4`` logger when the program shows its INFO
    records, else on stderr (as DeepSpeed's own logger does, whatever ``logging`` set-up the script has)."""
    if log.isEnabledFor(logging.INFO) and log.hasHandlers():
        log.info("%s", text)
    else:
        print(text, file=sys.stderr, flush=True)


def summary_line(state: NVFP4State, report: StorageReport | None = None) -> str:
    """One line: what is NVFP4, with which recipe and kernel, and how many bytes the packed weights take."""
    c, p = state.conversion, state.precision
    kept = c.kept_bf16
    kept_text = f"{len(kept)} kept BF16" + (f" ({', '.join(kept[:3])}{', ...' if len(kept) > 3 else ''})"
                                            if kept else "")
    total = c.fp4_params + c.bf16_params
    text = (f"ds_nvfp4: NVFP4 training ON: {len(c.converted)} GEMM weights NVFP4 ({c.fp4_by_kind()}), {kept_text}; "
            f"{c.fp4_params / total if total else 0:.1%} of all parameters; {p.describe_recipe()}; kernel {c.kernel}"
            + (f" ({state.selection.operand.split(' (')[0]})" if state.selection.operand else ""))
    if c.unknown:
        text += (f"; {len(c.unknown)} weights of unknown role kept BF16 ({sum(d.params for d in c.unknown):,} "
                 "parameters: see the table)")
    if c.fused_groups:
        text += f"; {len(c.fused_groups)} fused groups share an amax"
    if report is not None:
        text += (f"; ZeRO-3 weights packed: {report.packed_bytes:,} bytes vs {report.packed_bf16_equivalent_bytes:,} "
                 f"in BF16 ({report.ratio:.3f}x, rank {report.rank})")
    else:
        text += f"; {p.describe_storage(state.stage)}"
    return text
