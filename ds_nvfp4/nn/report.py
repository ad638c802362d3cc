"""`ConversionReport`: every Linear of the model with its decision and the reason, as a table and as JSON."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field


@dataclass
class LayerDecision:
    name: str
    in_features: int
    out_features: int
    params: int          # weight elements
    fp4: bool
    reason: str


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

    @property
    def converted(self) -> list[str]:
        return [d.name for d in self.layers if d.fp4]

    @property
    def kept_bf16(self) -> list[str]:
        return [d.name for d in self.layers if not d.fp4]

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
                 f"{'layer':<{w}}  {'shape':>13}  {'params':>10}  precision  reason",
                 f"{'-' * w}  {'-' * 13}  {'-' * 10}  ---------  ------"]
        for d in self.layers:
            shape = f"{d.out_features}x{d.in_features}"
            lines.append(f"{d.name:<{w}}  {shape:>13}  {d.params:>10,}  {'NVFP4' if d.fp4 else 'BF16':<9}  {d.reason}")
        frac = self.fp4_params / total if total else 0.0
        lines.append(f"{len(self.converted)} of {len(self.layers)} Linear layers in NVFP4; parameters: "
                     f"{self.fp4_params:,} NVFP4 ({frac:.1%}), {self.bf16_params:,} BF16")
        if self.fused_groups:
            lines.append(f"{len(self.fused_groups)} fused groups share one weight amax each (modules.fuse), e.g. "
                         f"{', '.join(self.fused_groups[0])}")
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)
