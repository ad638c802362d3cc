"""`ConversionReport`: every GEMM weight of the model with its decision and the reason, as a table and as JSON."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

#: the report kinds that are GEMM weights (the others: embedding, conv, unknown)
_GEMM_KINDS = ("Linear", "Conv1D", "experts", "router")


@dataclass
class LayerDecision:
    """One GEMM weight of the model: a Linear's or Conv1D's weight, or one 3-D experts parameter."""

    name: str            # the module's dotted name; for experts "<module>.<parameter>" (gate_up_proj, down_proj)
    in_features: int     # K of the GEMM
    out_features: int    # N of the GEMM (per expert)
    params: int          # weight elements (all experts)
    fp4: bool
    reason: str
    kind: str = "Linear"           # Linear, Conv1D, experts, router; embedding, conv, unknown (no GEMM row)
    experts: int | None = None     # E for a 3-D experts weight
    transposed: bool = False       # stored [K, N] (Conv1D; experts of classes with is_transposed)
    #: experts: how each expert's [N, K] matrix splits into the per-expert modules inference engines load,
    #: ``[[module, rows], ...]`` with rows "all", "first_half", "second_half", "even" or "odd"
    #: (``checkpoint.experts.PROJECTION_ROWS``); None where the layout is not declared (experts run their own forward)
    projections: list[list[str]] | None = None
    bias: str | None = None        # experts: the per-expert bias parameter ``[E, N]`` of this weight, if any


@dataclass
class ConversionReport:
    """What ``convert_model`` did. ``fp4_params``/``bf16_params`` count every model parameter."""

    layers: list[LayerDecision] = field(default_factory=list)
    kernel: str = "emulated"
    kernel_reason: str = ""
    blocks: str | None = None          # e.g. "blocks (6 x Block)"
    fp4_params: int = 0
    bf16_params: int = 0
    notes: list[str] = field(default_factory=list)
    #: groups of converted sibling Linears whose weights share one per-tensor amax (``modules.fuse``)
    fused_groups: list[list[str]] = field(default_factory=list)
    #: the MoE experts modules found (nn/moe.py), one line each: experts, how they run, their router
    moe: list[str] = field(default_factory=list)

    @property
    def unknown(self) -> list[LayerDecision]:
        """Weights of 2+ dimensions the converter could not classify (kept BF16)."""
        return [d for d in self.layers if d.kind == "unknown"]

    @property
    def converted(self) -> list[str]:
        return [d.name for d in self.layers if d.fp4]

    @property
    def kept_bf16(self) -> list[str]:
        """GEMM weights (and routers) kept BF16; embedding tables, convolutions and unknown weights aside."""
        return [d.name for d in self.layers if not d.fp4 and d.kind in _GEMM_KINDS]

    def fp4_by_kind(self) -> str:
        """E.g. "28 Linear, 16 experts tensors" (what is NVFP4, by module kind)."""
        counts: dict[str, int] = {}
        for d in self.layers:
            if d.fp4:
                counts[d.kind] = counts.get(d.kind, 0) + 1
        return ", ".join(f"{n} {'experts tensors' if k == 'experts' else k}" for k, n in counts.items()) or "nothing"

    def to_dict(self) -> dict:
        d = asdict(self)
        total = self.fp4_params + self.bf16_params
        d["fp4_fraction"] = self.fp4_params / total if total else 0.0
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def table(self) -> str:
        """A fixed-width table for logs."""
        w = max([len(d.name) for d in self.layers] + [5])
        total = self.fp4_params + self.bf16_params
        lines = [f"NVFP4 conversion: kernel {self.kernel} ({self.kernel_reason})",
                 f"transformer blocks: {self.blocks or 'none found'}",
                 f"{'layer':<{w}}  {'kind':<7}  {'shape':>16}  {'params':>11}  precision  reason",
                 f"{'-' * w}  {'-' * 7}  {'-' * 16}  {'-' * 11}  ---------  ------"]
        for d in self.layers:
            shape = (f"{d.experts}x" if d.experts else "") + f"{d.out_features}x{d.in_features}"
            precision = "NVFP4" if d.fp4 else "BF16"
            lines.append(f"{d.name:<{w}}  {d.kind:<7}  {shape:>16}  {d.params:>11,}  {precision:<9}  {d.reason}")
        frac = self.fp4_params / total if total else 0.0
        gemms = [d for d in self.layers if d.kind in _GEMM_KINDS]
        lines.append(f"{len(self.converted)} of {len(gemms)} GEMM weights in NVFP4 ({self.fp4_by_kind()}); "
                     f"parameters (all of the model's): {self.fp4_params:,} NVFP4 ({frac:.1%}), "
                     f"{self.bf16_params:,} BF16")
        if self.fused_groups:
            lines.append(f"{len(self.fused_groups)} fused groups share one weight amax each (modules.fuse), e.g. "
                         f"{', '.join(self.fused_groups[0])}")
        if self.unknown:
            names = ", ".join(d.name for d in self.unknown[:4]) + (", ..." if len(self.unknown) > 4 else "")
            lines.append(f"{len(self.unknown)} weights ds_nvfp4 cannot classify kept BF16 "
                         f"({sum(d.params for d in self.unknown):,} parameters): {names}")
        lines += [f"MoE: {line}" for line in self.moe]
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)
