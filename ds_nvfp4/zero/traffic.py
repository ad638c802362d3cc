"""The bytes ZeRO-3's collectives move per optimizer step, per rank, for a model and a precision section.

The textbook ZeRO-3 step: every parameter is all-gathered for the forward and again for the backward (each gather
hands every rank the whole tensor), and every gradient is reduce-scattered once (each rank contributes the whole
tensor). The payload of a gather is what one rank receives in full, of a reduce-scatter what it sends in full; a
ring algorithm puts (N-1)/N of either on each rank's link. DeepSpeed can do less: a parameter whose next use is
within ``stage3_max_reuse_distance`` stays gathered between the forward and the backward (bench/multihost.py counts
what really moved, docs/scaling.md compares the two).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

#: bytes per weight element of a packed NVFP4 partition, by block shape: 4-bit codes + one E4M3 scale per block
#: (the 4-byte amax per tensor is negligible)
NVFP4_BYTES_PER_PARAM = {"1x16": 0.5 + 1 / 16, "16x16": 0.5 + 1 / 256}
#: bytes per element of the collectives' other dtypes
DTYPE_BYTES = {"bf16": 2, "fp32": 4}


@dataclass(frozen=True)
class StepTraffic:
    """One rank's ZeRO-3 collective payload per optimizer step (bytes; see the module docstring).

    ``params``: all parameters; ``packed_params``: those stored as packed NVFP4 partitions (gathered as codes with
    ``all_gather="nvfp4"``, dequantized to BF16 first with ``"bf16"``).
    """

    params: int
    packed_params: int
    all_gather: str
    reduce_scatter: str
    gather_bytes_per_pass: float
    reduce_scatter_bytes: float
    gather_passes: int = 2

    @property
    def gather_bytes(self) -> float:
        return self.gather_passes * self.gather_bytes_per_pass

    @property
    def total_bytes(self) -> float:
        return self.gather_bytes + self.reduce_scatter_bytes

    @property
    def reduce_scatter_share(self) -> float:
        return self.reduce_scatter_bytes / self.total_bytes if self.total_bytes else 0.0

    def wire_bytes(self, world: int) -> float:
        """Bytes each rank sends on its link per step with ring collectives over ``world`` ranks."""
        return self.total_bytes * (world - 1) / world

    def as_dict(self) -> dict:
        return {**asdict(self), "gather_bytes": self.gather_bytes, "total_bytes": self.total_bytes,
                "reduce_scatter_share": self.reduce_scatter_share}

    def describe(self) -> str:
        """E.g. ``all-gather 2 x 24.1 MB (nvfp4: 12.6M packed params as codes, 6.7M BF16), reduce-scatter 38.6 MB
        (bf16): 86.8 MB per step and rank, 44% of it reduce-scatter``."""
        bf16 = self.params - self.packed_params
        if self.packed_params and self.all_gather == "nvfp4":
            what = f"nvfp4: {_m(self.packed_params)} packed params as codes + scales, {_m(bf16)} BF16"
        elif self.packed_params:
            what = f"bf16: {_m(self.packed_params)} packed params dequantized before the gather, {_m(bf16)} BF16"
        else:
            what = f"bf16: {_m(self.params)} params"
        return (f"all-gather {self.gather_passes} x {_mb(self.gather_bytes_per_pass)} ({what}), reduce-scatter "
                f"{_mb(self.reduce_scatter_bytes)} ({self.reduce_scatter}): {_mb(self.total_bytes)} per step and rank, "
                f"{self.reduce_scatter_share:.0%} of it reduce-scatter")


def step_traffic(params: int, packed_params: int = 0, *, all_gather: str = "bf16", reduce_scatter: str = "bf16",
                 block: str = "1x16") -> StepTraffic:
    """:class:`StepTraffic` of a model of ``params`` parameters, ``packed_params`` of them packed NVFP4."""
    if not 0 <= packed_params <= params:
        raise ValueError(f"packed_params={packed_params} must be within 0..params={params}")
    per_packed = NVFP4_BYTES_PER_PARAM[block] if all_gather == "nvfp4" else DTYPE_BYTES["bf16"]
    gather = packed_params * per_packed + (params - packed_params) * DTYPE_BYTES["bf16"]
    return StepTraffic(params, packed_params, all_gather, reduce_scatter, gather,
                       params * DTYPE_BYTES[reduce_scatter])


def _mb(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def _m(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def engine_traffic(engine) -> StepTraffic:
    """:class:`StepTraffic` of a ZeRO-3 engine (a ``ds_nvfp4.initialize`` one or plain DeepSpeed's).

    Counts every parameter once (tied ones too) by its full size ``ds_numel``; packed are the weights whose
    partitions the store holds as NVFP4 (a converted weight whose partition cuts its blocks is stored BF16).
    """
    params = sum(int(getattr(p, "ds_numel", p.numel())) for p in {id(p): p for p in engine.module.parameters()}
                 .values())
    state = getattr(engine, "ds_nvfp4", None)
    store = getattr(state, "store", None)
    if store is None:
        return step_traffic(params)
    packed = sum(int(e.param.ds_numel) for e in store.entries.values() if e.packable)
    pc = state.precision
    return step_traffic(params, packed, all_gather=pc.communication.all_gather,
                        reduce_scatter=pc.communication.reduce_scatter, block=pc.weights.block)
