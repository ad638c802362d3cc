"""`StorageReport`: what one rank's packed ZeRO-3 storage holds (zero/packed.py builds it), in bytes."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StorageReport:
    """Per-rank storage of the model's partitions (bytes are this rank's resident partition bytes)."""

    rank: int
    all_gather: str
    packed_params: int = 0
    packed_bytes: int = 0
    packed_bf16_equivalent_bytes: int = 0
    bf16_params: int = 0
    bf16_bytes: int = 0
    kept_bf16: dict[str, str] = field(default_factory=dict)   # converted weights stored BF16, with the reason
    frozen_params: int = 0                                      # of the packed ones: frozen (no master, no state)
    frozen_bytes: int = 0
    frozen_source: str = ""                                     # where the frozen codes came from
    gathered_bytes: int = 0                                     # bytes received by gathers of packed weights

    @property
    def ratio(self) -> float:
        """Packed bytes / the BF16 bytes the same partitions would take."""
        return self.packed_bytes / self.packed_bf16_equivalent_bytes if self.packed_bf16_equivalent_bytes else 1.0

    def summary(self) -> str:
        s = (f"ds_nvfp4 storage rank {self.rank}: {self.packed_params} weight partitions packed NVFP4, "
             f"{self.packed_bytes:,} bytes vs {self.packed_bf16_equivalent_bytes:,} in BF16 ({self.ratio:.4f}x); "
             f"{self.bf16_params} partitions BF16 ({self.bf16_bytes:,} bytes); all-gather {self.all_gather}")
        if self.frozen_params:
            s += (f"\n  frozen base: {self.frozen_params} of the packed partitions ({self.frozen_bytes:,} bytes), no "
                  f"FP32 master or optimizer state, codes {self.frozen_source}")
        for name, why in self.kept_bf16.items():
            s += f"\n  converted weight kept BF16: {name}: {why}"
        return s

    def to_dict(self) -> dict:
        from dataclasses import asdict

        d = asdict(self)
        d["ratio"] = self.ratio
        return d
