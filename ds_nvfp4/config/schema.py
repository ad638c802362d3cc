"""The ``precision`` section of a ds_config, as pydantic models in DeepSpeed's style.

Importing this module needs neither DeepSpeed nor torch.distributed. Names and defaults are the contract
documented in docs/config.md; every model forbids unknown keys, and every value is checked strictly (JSON
``true`` for booleans, integers for counts). ``"auto"`` is rejected before these models run (see checks.py).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ..format.scaling import WeightScaling


class StrictModel(BaseModel):
    """Like DeepSpeed's ``DeepSpeedConfigModel``: unknown keys are errors; values are not coerced."""

    model_config = ConfigDict(extra="forbid", strict=True, validate_assignment=True, frozen=False)


class WeightsConfig(StrictModel):
    storage: Literal["nvfp4", "bf16"] | None = Field(
        None, description="nvfp4: ZeRO-3 partitions of converted weights kept packed; bf16: DeepSpeed's own; null "
                          "(default): follow the ZeRO stage (packed under ZeRO-3, BF16 under ZeRO-0/1/2, where "
                          "every rank holds the full BF16 model and there is nothing to pack)")
    block: Literal["16x16", "1x16"] = Field(
        "16x16", description="weight block layout; 16x16 is closed under transposition (needed by the FP4 backward)")
    scaling: Literal["6", "4over6"] = Field(
        "6", description="block scaling of the weights: \"6\" (standard NVFP4: each block's max maps to 6) or "
                         "\"4over6\" (each block maps to 4 or to 6, whichever reconstructs it with less error; "
                         "arXiv 2512.02010, Transformer Engine's nvfp4_4over6). Encoder side only: the codes and "
                         "scales stay standard NVFP4, exports included")
    e4m3_bound: Literal[256, 448] | None = Field(
        None, description="the global E4M3 bound of the per-tensor weight scale (S_enc = 6 * bound / amax): null "
                          "takes 448 with scaling \"6\" and 256 with \"4over6\" (TE's nvfp4_4over6_e4m3_use_256: "
                          "the block holding the tensor's amax can then map to 4 without its scale saturating)")
    scaling_error: Literal["MAE", "MSE"] = Field(
        "MAE", description="4over6 only: the error that picks map-to-4 or map-to-6 per block (TE's "
                           "nvfp4_4over6_err_mode)")

    def bound(self) -> int:
        """The global E4M3 bound the weights are quantized with (448 standard, 256 by default with 4over6)."""
        if self.e4m3_bound is not None:
            return self.e4m3_bound
        return 256 if self.scaling == "4over6" else 448

    def quantization(self) -> WeightScaling:
        """These weights' block scaling, as ``ds_nvfp4.quantize``'s ``scaling`` and the recipe carry it."""
        return WeightScaling(self.scaling, self.bound(), self.scaling_error)


class ActivationsConfig(StrictModel):
    block: Literal["1x16"] = Field("1x16", description="forward input block layout (dynamic per-tensor amax)")
    hadamard: bool = Field(False, description="RHT on both forward GEMM operands along K (activation smoothing)")


class BackwardConfig(StrictModel):
    gemm: Literal["bf16", "nvfp4"] = Field(
        "bf16", description="bf16: only forward GEMMs in FP4 (BF16 Dgrad/Wgrad); nvfp4: Dgrad/Wgrad in FP4 too")
    stochastic_rounding: bool = Field(True, description="stochastic rounding of gradients (gemm=nvfp4 only)")
    hadamard: bool = Field(True, description="RHT of the Wgrad operands along the token dim (gemm=nvfp4 only)")


class CommunicationConfig(StrictModel):
    all_gather: Literal["bf16", "nvfp4"] = Field(
        "bf16", description="bf16: dequantize then gather; nvfp4: gather packed bytes (3.5x less traffic, same bits)")
    reduce_scatter: Literal["bf16", "fp32"] = Field("bf16", description="gradient reduce-scatter dtype")


class ModuleRule(StrictModel):
    """One entry of ``modules.overrides``: modules whose name matches ``match`` take ``precision``."""

    match: str = Field(description="fnmatch pattern over a module's dotted name (or any dotted suffix of it)")
    precision: Literal["bf16", "fp4"] = Field(description="bf16: keep the module BF16; fp4: the recipe's FP4 GEMMs "
                                                          "(still subject to the shape rules)")


class ModulesConfig(StrictModel):
    include: list[str] = Field(["*"], description="fnmatch patterns over model.named_modules() names")
    exclude: list[str] = Field(["lm_head", "*embed*"], description="patterns kept BF16; exclude wins over include")
    keep_first_blocks_bf16: int = Field(0, ge=0, description="leading transformer blocks kept BF16")
    keep_last_blocks_bf16: int = Field(0, ge=0, description="trailing transformer blocks kept BF16")
    keep_last_fraction_bf16: float = Field(
        0.0, ge=0.0, lt=1.0, description="fraction of the transformer blocks, counted from the end, kept BF16, rounded "
                                         "up (0.15 of 32 blocks: the last 5); with keep_last_blocks_bf16 the larger "
                                         "of the two")
    overrides: list[ModuleRule] = Field(
        [], description="ordered per-module rules (Megatron-style per-module precision): the first whose pattern "
                        "matches decides, before include/exclude and the block rules; e.g. "
                        '[{"match": "*.mlp.experts", "precision": "fp4"}, {"match": "layers.3.*", "precision": '
                        '"bf16"}]')
    fuse: list[list[str]] = Field(
        [["q_proj", "k_proj", "v_proj"], ["gate_proj", "up_proj"]],
        description="sibling Linear names that inference engines fuse into one GEMM (vLLM qkv_proj, gate_up_proj): "
                    "their weights share one per-tensor amax (global scale), so an export is exact; [] turns it off")


class MonitorConfig(StrictModel):
    enabled: bool = Field(False, description="per-layer quantization statistics to DeepSpeed's monitor")
    interval: int = Field(100, ge=1, description="steps between two statistics snapshots")


class NonFiniteConfig(StrictModel):
    action: Literal["raise", "skip"] = Field(
        "raise", description="a step whose gradients hold NaN/Inf: raise NonFiniteError on every rank (masters "
                             "unchanged), or skip it (DeepSpeed's skip, counted and reported)")
    max_consecutive_skips: int = Field(8, ge=0, description="skip: more skipped steps in a row than this raise")


class SpikeGuardConfig(StrictModel):
    """The loss-spike guard (``precision.schedule.spike_guard``): a step whose loss jumps runs the next steps BF16."""

    loss_ratio: float = Field(
        1.5, gt=1.0, description="a step whose loss (mean over its micro-batches and all ranks) exceeds this multiple "
                                 "of the median loss of the previous `window` steps starts an episode")
    window: int = Field(10, ge=3, description="how many previous steps' losses the median is taken over; no "
                                              "episode starts before that many steps are seen")
    bf16_steps: int = Field(50, ge=1, description="optimizer steps each episode runs every converted layer in BF16 "
                                                  "(BF16 GEMMs and BF16 weights), from the step after the spike")
    max_episodes: int = Field(3, ge=1, description="at most this many episodes per run; a spike after them is "
                                                   "reported and FP4 goes on")


class ScheduleConfig(StrictModel):
    """When the FP4 GEMMs run (optimizer steps counted from 1, as DeepSpeed's ``global_steps`` after the step)."""

    bf16_warmup_steps: int = Field(
        0, ge=0, description="the first N optimizer steps run every converted layer in BF16 (BF16 GEMMs and, with "
                             "packed storage, BF16 weight partitions); FP4 from step N+1 on")
    bf16_from: int | float | Literal["lr_decay"] | None = Field(
        None, description="the late switch: the first optimizer step (an integer >= 1) from which the GEMMs named "
                          "in bf16_gemms run in BF16, a fraction of total_steps (a number in (0, 1): 0.85 runs "
                          "the last 15% in BF16), or \"lr_decay\": the first step of the learning-rate decay of a "
                          "warmup-stable-decay schedule, read from the run's own learning rate (any scheduler); "
                          "null: no switch",
        # the ranges, for editors and `ds-nvfp4 schema` (config/checks.py enforces them with a message that says why)
        json_schema_extra={"anyOf": [{"type": "integer", "minimum": 1},
                                     {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1},
                                     {"const": "lr_decay"}, {"type": "null"}]})
    bf16_gemms: Literal["forward", "backward", "all"] = Field(
        "forward", description="which FP4 GEMMs the late switch turns to BF16: forward (Fprop, the paper's switch; "
                               "with BF16 weights), backward (Dgrad and Wgrad; backward.gemm nvfp4 only) or all")
    total_steps: int | None = Field(
        None, ge=1, description="the run's number of optimizer steps (needed when bf16_from is a fraction; null "
                                "takes the DeepSpeed scheduler's params.total_num_steps)")
    spike_guard: SpikeGuardConfig | None = Field(
        None, description="the loss-spike guard: {} turns it on with its defaults (a loss above 1.5x the median of "
                          "the last 10 steps runs the next 50 steps BF16, at most 3 times); null: off")


class BaseConfig(StrictModel):
    """The base model of a fine-tune: frozen (adapters such as PEFT LoRA train beside it) and/or read from a
    published NVFP4 checkpoint (docs/finetune.md)."""

    frozen: bool = Field(
        False, description="freeze every converted weight (requires_grad false): no FP32 master, no gradient, no "
                           "optimizer state; under ZeRO-3 their partitions are packed NVFP4 once and never "
                           "re-quantized. The parameters left trainable (adapters, or what the model leaves "
                           "trainable) train as usual")
    checkpoint: str | None = Field(
        None, description="a compressed-tensors nvfp4-pack-quantized or ModelOpt NVFP4 HF folder the base is read "
                          "from. With frozen true (LoRA): each rank reads its own ZeRO-3 slice of the codes and "
                          "scales, which the forward multiplies as stored (needs ZeRO-3, weights.block \"1x16\" and "
                          "communication.all_gather \"nvfp4\"); with frozen false (continued training): the FP32 "
                          "masters start at the dequantized codes. Modules the checkpoint keeps BF16 stay BF16")


class PrecisionConfig(StrictModel):
    """The whole ``"precision"`` section. ``PrecisionConfig()`` gives the documented defaults."""

    enabled: bool = Field(False, description="turn NVFP4 training on")
    format: Literal["nvfp4"] = Field("nvfp4", description="the 4-bit format (only nvfp4 for now)")
    weights: WeightsConfig = Field(default_factory=WeightsConfig)
    activations: ActivationsConfig = Field(default_factory=ActivationsConfig)
    backward: BackwardConfig = Field(default_factory=BackwardConfig)
    communication: CommunicationConfig = Field(default_factory=CommunicationConfig)
    modules: ModulesConfig = Field(default_factory=ModulesConfig)
    kernel: str | None = Field(
        None, description="GEMM backend, one registered in ds_nvfp4/kernels (kernels/registry.py); null picks the "
                          "best available and logs why",
        json_schema_extra=lambda schema: schema.update(anyOf=[{"enum": list(kernel_names())}, {"type": "null"}]))
    monitor: MonitorConfig = Field(default_factory=MonitorConfig)
    nonfinite: NonFiniteConfig = Field(default_factory=NonFiniteConfig)
    schedule: ScheduleConfig = Field(default_factory=ScheduleConfig)
    base: BaseConfig = Field(default_factory=BaseConfig)

    @field_validator("kernel")
    @classmethod
    def _registered_kernel(cls, v: str | None) -> str | None:
        names = kernel_names()
        if v is not None and v not in names:
            raise ValueError(f"{v!r} is not a GEMM backend: allowed {', '.join(map(repr, names))}, or null")
        return v

    def stored_packed(self, stage: int) -> bool:
        """Whether converted weights are stored packed NVFP4 at ZeRO ``stage`` (``weights.storage`` null follows the
        stage: packed under ZeRO-3 only)."""
        return self.weights.storage == "nvfp4" or (self.weights.storage is None and stage == 3)

    def describe_storage(self, stage: int) -> str:
        """How converted weights are stored, with the reason when the stage decided it."""
        how = "packed NVFP4" if self.stored_packed(stage) else "BF16"
        why = (f"weights.storage {self.weights.storage!r}" if self.weights.storage
               else f"ZeRO-{stage}: storage follows the stage (weights.storage null)")
        return f"weights stored {how} ({why})"

    def last_blocks_bf16(self, blocks: int) -> int:
        """How many trailing blocks of a model with ``blocks`` blocks stay BF16 (the count or the fraction)."""
        import math

        frac = self.modules.keep_last_fraction_bf16
        return max(self.modules.keep_last_blocks_bf16, math.ceil(frac * blocks - 1e-9) if frac else 0)

    def describe_recipe(self) -> str:
        """What the recipe does, in words (user-facing output names recipes by what they do, not by a label)."""
        if self.backward.gemm == "nvfp4":
            extras = [x for x, on in (("stochastic rounding", self.backward.stochastic_rounding),
                                      ("RHT", self.backward.hadamard)) if on]
            text = "FP4 forward and backward GEMMs" + (f" (gradients: {', '.join(extras)})" if extras else "")
        else:
            text = "FP4 forward GEMMs, BF16 backward"
        scaling = (f" with 4/6 scaling (bound {self.weights.bound()}, {self.weights.scaling_error})"
                   if self.weights.scaling == "4over6" else "")
        return text + f", weights in {self.weights.block} blocks{scaling}" + (
            ", RHT on the forward operands" if self.activations.hadamard else "")


#: What to write instead of ``"auto"``, per key (the default is the fallback suggestion).
AUTO_ADVICE = {
    "kernel": "write null to let ds_nvfp4 pick the best available GEMM backend (it logs its choice)",
}


def kernel_names() -> tuple[str, ...]:
    """The GEMM backends ``precision.kernel`` accepts: those registered in ds_nvfp4/kernels (kernels/registry.py),
    most preferred first. Imported on first use: validating a config loads the backend files, nothing else."""
    from ..kernels.registry import names

    return names()
