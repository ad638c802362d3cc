"""Published NVFP4 checkpoints (issue 38): a compressed-tensors ``nvfp4-pack-quantized`` or ModelOpt NVFP4 HF folder,
validated from its configuration and safetensors headers alone, and read one weight (or one row range of it) at a
time, exactly as stored.

:func:`open_nvfp4_checkpoint` reads no tensor data beyond the per-tensor global scales: every problem (a checkpoint
that is not NVFP4, a missing or truncated shard, a code or scale tensor of the wrong shape or dtype, a group size
other than 16, different global scales inside a fused group) is one :class:`CheckpointError` naming the tensor and
the file, before anything allocates a model. :meth:`NVFP4Checkpoint.read` then returns a weight's codes and E4M3
block scales with ``safe_open(...).get_slice``: a rank that holds rows ``[a, b)`` reads only those bytes.

Layouts (the same tables as ``export/formats.py``, which writes them): codes uint8 ``[N, K/2]`` (two E2M1 codes per
byte, low nibble first), block scales E4M3 ``[N, K/16]``, and the per-tensor global scale, ModelOpt's
``weight_scale_2 = amax / 2688`` (decode form) or compressed-tensors' ``weight_global_scale = 2688 / amax`` (encode
form). :meth:`NVFP4Checkpoint.read_flat` gives a ZeRO-3 partition's element range, which the packed storage takes as
its codes for a frozen base (``precision.base``, engine/base.py).
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..format import NVFP4Storage
from ..format.constants import BLOCK_SIZE, E4M3_MAX
from .metadata import CheckpointError

#: ``(quant_method or producer, what is checked)``: the two published NVFP4 layouts
FORMATS = ("compressed-tensors", "modelopt")
#: the projections a serving engine fuses into one GEMM, which must then share one global scale
FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
_DTYPES = {"codes": ("U8",), "scale": ("F8_E4M3",), "global": ("F32",)}


@dataclass(frozen=True)
class QuantizedWeight:
    """One NVFP4 weight of the checkpoint: its tensors' names, the shard holding them and the weight's shape."""

    module: str
    file: Path
    codes: str
    scale: str
    global_scale: str
    shape: tuple[int, int]  # [N, K] of the dequantized weight


@dataclass
class NVFP4Checkpoint:
    """A validated NVFP4 HF folder. ``weights``: every quantized Linear by module name; ``tensors``: every tensor
    name -> shard; ``ignore``: the modules the checkpoint keeps in BF16 (its ``ignore`` / ``exclude_modules``)."""

    folder: Path
    format: str
    weights: dict[str, QuantizedWeight]
    tensors: dict[str, Path]
    ignore: list[str] = field(default_factory=list)

    def amax(self, module: str) -> torch.Tensor:
        """float32 0-dim per-tensor amax of ``module``'s weight, from its global scale."""
        w = self.weights[module]
        g = _read(w.file, w.global_scale).float().reshape(())
        return g * 2688.0 if self.format == "modelopt" else 2688.0 / g

    def read(self, module: str, rows: slice | None = None) -> NVFP4Storage:
        """The stored codes and scales of ``module``'s weight (rows ``rows`` only, read from disk alone) as a
        1x16-block :class:`NVFP4Storage` of shape ``[rows, K]``."""
        from safetensors import safe_open

        w = self.weights[module]
        n, k = w.shape
        start, stop, _ = (rows or slice(None)).indices(n)
        with safe_open(str(w.file), framework="pt") as f:
            data = f.get_slice(w.codes)[start:stop]
            scale = f.get_slice(w.scale)[start:stop]
        return NVFP4Storage(data.contiguous(), scale.contiguous(), self.amax(module), torch.Size((stop - start, k)),
                            "1x16", E4M3_MAX)

    def read_flat(self, module: str, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The stored codes of elements ``[start, stop)`` of ``module``'s row-major ``[N, K]`` weight (a ZeRO-3
        partition's range; both multiples of 16): ``(data uint8 [(stop-start)/2], scale float8_e4m3fn
        [(stop-start)/16], amax float32 0-dim)``. Only the rows the range touches are read from disk."""
        n, k = self.weights[module].shape
        if start % BLOCK_SIZE or stop % BLOCK_SIZE or not 0 <= start <= stop <= n * k:
            raise ValueError(f"{module}: element range [{start}, {stop}) of a {n}x{k} weight is not a whole number "
                             "of 1x16 blocks inside it")
        q, at = self._rows_of(module, start, stop)
        return (q.data.reshape(-1).narrow(0, at // 2, (stop - start) // 2),
                q.scale.reshape(-1).narrow(0, at // BLOCK_SIZE, (stop - start) // BLOCK_SIZE), q.amax)

    def dequantize_flat(self, module: str, start: int, stop: int) -> torch.Tensor:
        """float32 elements ``[start, stop)`` of ``module``'s row-major dequantized weight (any range), reading only
        the rows it touches."""
        q, at = self._rows_of(module, start, stop)
        return q.dequantize(torch.float32).reshape(-1)[at: at + stop - start]

    def _rows_of(self, module: str, start: int, stop: int) -> tuple[NVFP4Storage, int]:
        """The stored rows element range ``[start, stop)`` touches, and where the range starts in them."""
        k = self.weights[module].shape[1]
        first = start // k
        return self.read(module, slice(first, -(-stop // k))), start - first * k

    def tensor(self, name: str) -> torch.Tensor:
        """A tensor of the folder as stored (a BF16 layer, a bias); an error naming the folder if it has none."""
        if name not in self.tensors:
            raise CheckpointError(f"{self.folder}: has no tensor {name}")
        return _read(self.tensors[name], name)


def open_nvfp4_checkpoint(folder: str | os.PathLike) -> NVFP4Checkpoint:
    """Validate an NVFP4 HF folder from its config and headers (see the module docstring); raises
    :class:`CheckpointError` naming the file and the tensor."""
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: no such checkpoint folder")
    fmt, ignore = _quantization(folder)
    tensors, headers = _shards(folder)
    weights = {}
    suffixes = ({"codes": "weight", "scale": "weight_scale", "global": "weight_scale_2"} if fmt == "modelopt" else
                {"codes": "weight_packed", "scale": "weight_scale", "global": "weight_global_scale"})
    for name in tensors:
        if not name.endswith("." + suffixes["scale"]):
            continue
        module = name.removesuffix("." + suffixes["scale"])
        names = {role: f"{module}.{s}" for role, s in suffixes.items()}
        missing = [t for t in names.values() if t not in tensors]
        if missing:
            raise CheckpointError(f"{tensors[name]}: {module} has {name} but not {', '.join(missing)} (an NVFP4 "
                                  f"weight in {fmt} format has {', '.join(names.values())})")
        weights[module] = _check_weight(module, names, tensors, headers)
    if not weights:
        raise CheckpointError(f"{folder}: the config declares NVFP4 ({fmt}) but no tensor ends in "
                              f".{suffixes['scale']}: not an NVFP4 checkpoint")
    ckpt = NVFP4Checkpoint(folder, fmt, weights, tensors, ignore)
    _check_fused(ckpt)
    return ckpt


def _quantization(folder: Path) -> tuple[str, list[str]]:
    """``(format, ignored modules)`` from ``hf_quant_config.json`` (ModelOpt) or ``config.json``'s
    ``quantization_config``; an error naming the file and what it declares when that is not NVFP4."""
    modelopt = folder / "hf_quant_config.json"
    if modelopt.is_file():
        q = _json(modelopt).get("quantization", {})
        algo = q.get("quant_algo")
        if algo not in ("NVFP4", "W4A16_NVFP4"):
            raise CheckpointError(f"{modelopt}: quantization.quant_algo is {algo!r}, not NVFP4 (allowed: 'NVFP4', "
                                  "'W4A16_NVFP4'); ds_nvfp4 fine-tunes NVFP4 checkpoints only")
        _group_size(q.get("group_size"), modelopt, "quantization.group_size")
        return "modelopt", list(q.get("exclude_modules") or [])
    config = folder / "config.json"
    if not config.is_file():
        raise CheckpointError(f"{folder}: neither hf_quant_config.json nor config.json: not an HF checkpoint folder")
    qc = _json(config).get("quantization_config")
    if not qc:
        raise CheckpointError(f"{config}: no quantization_config: a BF16/FP32 checkpoint, not NVFP4 (train it with "
                              "a precision section instead; `ds-nvfp4 export` writes NVFP4 folders)")
    method = qc.get("quant_method")
    if method == "modelopt":
        algo = qc.get("quant_algo")
        if algo not in ("NVFP4", "W4A16_NVFP4"):
            raise CheckpointError(f"{config}: quantization_config.quant_algo is {algo!r}, not NVFP4")
        _group_size(qc.get("group_size", BLOCK_SIZE), config, "quantization_config.group_size")
        return "modelopt", list(qc.get("exclude_modules") or qc.get("ignore") or [])
    if method != "compressed-tensors" or qc.get("format") != "nvfp4-pack-quantized":
        raise CheckpointError(f"{config}: quantization_config is quant_method {method!r}, format "
                              f"{qc.get('format')!r}, not NVFP4 (allowed: compressed-tensors 'nvfp4-pack-quantized' "
                              "or a ModelOpt NVFP4 folder)")
    for gname, group in (qc.get("config_groups") or {}).items():
        w = group.get("weights") or {}
        path = f"quantization_config.config_groups.{gname}.weights"
        if (w.get("num_bits"), w.get("type")) != (4, "float"):
            raise CheckpointError(f"{config}: {path} is {w.get('num_bits')}-bit {w.get('type')!r}, not 4-bit float")
        _group_size(w.get("group_size"), config, f"{path}.group_size")
    return "compressed-tensors", list(qc.get("ignore") or [])


def _group_size(value, file: Path, path: str) -> None:
    if value != BLOCK_SIZE:
        raise CheckpointError(f"{file}: {path} is {value!r}; NVFP4 blocks are 16 elements (allowed: 16)")


def _json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: unreadable ({exc})") from None


def _shards(folder: Path) -> tuple[dict[str, Path], dict[Path, dict]]:
    """Every tensor name -> its shard, and every shard's safetensors header, each shard checked complete."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _json(index).get("weight_map", {})
        files = {name: folder / f for name, f in weight_map.items()}
    else:
        files = None
    shards = sorted(set(files.values())) if files else sorted(folder.glob("*.safetensors"))
    if not shards:
        raise CheckpointError(f"{folder}: no *.safetensors file")
    headers = {}
    for shard in shards:
        if not shard.is_file():
            raise CheckpointError(f"{shard}: missing (named by {index.name})")
        headers[shard] = _header(shard)
    tensors = {}
    for shard, header in headers.items():
        for name in header:
            if files is not None and files.get(name) != shard:
                raise CheckpointError(f"{shard}: holds {name}, which {index.name} places in {files.get(name)}")
            tensors[name] = shard
    if files is not None:
        absent = [n for n in files if n not in tensors]
        if absent:
            raise CheckpointError(f"{files[absent[0]]}: has no tensor {absent[0]} (named by {index.name})")
    return tensors, headers


def _header(shard: Path) -> dict:
    """The safetensors header of ``shard`` (tensor name -> dtype, shape, offsets), checked against the file's size."""
    size = shard.stat().st_size
    with open(shard, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{shard}: truncated ({size} bytes, no safetensors header)")
        (n,) = struct.unpack("<Q", head)
        if 8 + n > size:
            raise CheckpointError(f"{shard}: truncated (a {n}-byte header in a {size}-byte file)")
        try:
            header = json.loads(fh.read(n))
        except ValueError:
            raise CheckpointError(f"{shard}: damaged safetensors header") from None
    header.pop("__metadata__", None)
    end = max((t["data_offsets"][1] for t in header.values()), default=0)
    if 8 + n + end > size:
        raise CheckpointError(f"{shard}: truncated ({size} bytes; its tensors need {8 + n + end})")
    return header


def _check_weight(module: str, names: dict[str, str], tensors: dict[str, Path],
                  headers: dict[Path, dict]) -> QuantizedWeight:
    info = {role: headers[tensors[t]][t] for role, t in names.items()}
    for role, t in names.items():
        if info[role]["dtype"] not in _DTYPES[role]:
            raise CheckpointError(f"{tensors[t]}: {t} is {info[role]['dtype']}, expected {_DTYPES[role][0]}")
    codes, scale, glob = (info[r]["shape"] for r in ("codes", "scale", "global"))
    if len(codes) != 2:
        raise CheckpointError(f"{tensors[names['codes']]}: {names['codes']} has shape {codes}, expected [N, K/2]")
    n, k = codes[0], codes[1] * 2
    if k % BLOCK_SIZE or scale != [n, k // BLOCK_SIZE]:
        raise CheckpointError(f"{tensors[names['scale']]}: {names['scale']} has shape {scale}, expected "
                              f"{[n, k // BLOCK_SIZE]} (one E4M3 scale per 16 elements of each row of the {n}x{k} "
                              "weight)")
    if glob not in ([], [1]):
        raise CheckpointError(f"{tensors[names['global']]}: {names['global']} has shape {glob}, expected one "
                              "per-tensor value ([] or [1])")
    files = {tensors[t] for t in names.values()}
    if len(files) != 1:
        raise CheckpointError(f"{module}: its tensors are split over {', '.join(map(str, sorted(files)))}")
    return QuantizedWeight(module, files.pop(), names["codes"], names["scale"], names["global"], (n, k))


def _check_fused(ckpt: NVFP4Checkpoint) -> None:
    """Projections served as one GEMM must share their global scale (the fused GEMM has one)."""
    for module in ckpt.weights:
        parent, _, leaf = module.rpartition(".")
        for group in FUSED:
            if leaf != group[0]:
                continue
            members = [f"{parent}.{m}" if parent else m for m in group]
            present = [m for m in members if m in ckpt.weights]
            scales = {m: float(_read(ckpt.weights[m].file, ckpt.weights[m].global_scale).reshape(-1)[0])
                      for m in present}
            if len(set(scales.values())) > 1:
                shown = ", ".join(f"{ckpt.weights[m].global_scale} = {v:g}" for m, v in scales.items())
                raise CheckpointError(f"{ckpt.weights[present[0]].file}: the fused group {', '.join(present)} has "
                                      f"different global scales ({shown}); a fused GEMM has one")


def _read(file: Path, name: str) -> torch.Tensor:
    from safetensors import safe_open

    with safe_open(str(file), framework="pt") as f:
        return f.get_tensor(name)


def checkpoint_name(name: str) -> str:
    """A model parameter's (or module's) name as the checkpoint spells it: PEFT's wrapping
    (``base_model.model.`` prefix, ``.base_layer`` of a tuned layer) removed."""
    name = name.removeprefix("base_model.model.")
    return ".".join(part for part in name.split(".") if part != "base_layer")


@dataclass
class LoadReport:
    """What :func:`load_dequantized` did: weights set from NVFP4 codes, tensors copied as stored, weights left to
    come packed from their codes, parameters the checkpoint does not hold (adapters), and checkpoint tensors no
    parameter took (tied weights, buffers)."""

    from_codes: list[str] = field(default_factory=list)
    as_stored: list[str] = field(default_factory=list)
    packed: list[str] = field(default_factory=list)
    new: list[str] = field(default_factory=list)
    unused: list[str] = field(default_factory=list)

    def summary(self) -> str:
        return (f"{len(self.from_codes)} weights from NVFP4 codes, {len(self.as_stored)} tensors as stored"
                + (f", {len(self.packed)} weights to be packed from their stored codes" if self.packed else "")
                + (f", {len(self.new)} parameters not in the checkpoint (adapters: kept as initialized)"
                   if self.new else "")
                + (f", {len(self.unused)} checkpoint tensors unused ({', '.join(self.unused[:4])}"
                   f"{', ...' if len(self.unused) > 4 else ''})" if self.unused else ""))


def load_dequantized(model: torch.nn.Module, ckpt: NVFP4Checkpoint, *, packed: frozenset[str] = frozenset(),
                     new: frozenset[str] = frozenset(),
                     experts: Mapping[str, Callable[[], torch.Tensor]] | None = None) -> LoadReport:
    """Continued training from an NVFP4 checkpoint: set every parameter of ``model`` (names as in the checkpoint,
    PEFT's wrapping aside: :func:`checkpoint_name`) to the checkpoint's values, the quantized weights dequantized
    from their stored codes (the FP32 masters then start exactly at the checkpoint's weights, so the first BF16
    forward reproduces its logits). Under ZeRO-3 (``zero.Init``) each parameter is gathered, set on every rank and
    re-partitioned. ``packed``: parameter names left alone because their codes are packed straight into their
    partitions (a frozen base); ``new``: parameter names the checkpoint may lack (adapters); ``experts``: fused MoE
    experts parameters (and biases) the checkpoint stores per expert, name -> their assembled value
    (``checkpoint.experts.experts_from_checkpoint``), set from it unless ``packed``. Any other parameter the
    checkpoint lacks, or a shape that differs, is an error naming it and the folder; nothing is changed then."""

    params = dict(model.named_parameters())
    experts = experts or {}
    report = LoadReport()
    plan = []
    for name, p in params.items():
        shape = tuple(getattr(p, "ds_shape", p.shape))
        stored = checkpoint_name(name)
        module = stored.removesuffix(".weight")
        if name in experts:
            (report.packed if name in packed else report.from_codes).append(name)
            if name not in packed:
                plan.append((name, p, None, experts[name]))
        elif stored.endswith(".weight") and module in ckpt.weights:
            want = ckpt.weights[module].shape
            if tuple(want) != shape:
                raise CheckpointError(f"{ckpt.weights[module].file}: {module} is {list(want)} in the checkpoint, "
                                      f"{list(shape)} in the model")
            if name in packed:
                report.packed.append(name)
                continue
            plan.append((name, p, module, None))
        elif name in packed:
            raise CheckpointError(f"{ckpt.folder}: {stored} is not an NVFP4 weight of the checkpoint, so its codes "
                                  "cannot be packed as stored")
        elif stored in ckpt.tensors:
            plan.append((name, p, None, ckpt.tensors[stored]))
        elif name in new:
            report.new.append(name)
        else:
            raise CheckpointError(f"{ckpt.folder}: has no tensor for the model's parameter {stored} "
                                  f"(shape {list(shape)})")
    for name, p, module, file in plan:
        stored = checkpoint_name(name)
        if callable(file):  # an experts parameter, assembled from the per-expert tensors
            value = file()
        elif module is not None:
            value = ckpt.read(module).dequantize(torch.float32)
            report.from_codes.append(name)
        else:
            value = ckpt.tensor(stored)
            if tuple(value.shape) != tuple(getattr(p, "ds_shape", p.shape)):
                raise CheckpointError(f"{file}: {stored} has shape {list(value.shape)}, the model's parameter "
                                      f"{list(getattr(p, 'ds_shape', p.shape))}")
            report.as_stored.append(name)
        assign_parameter(p, value)
    quantized = {checkpoint_name(name).removesuffix(".weight") for name in report.from_codes + report.packed}
    stored = {checkpoint_name(name) for name in report.as_stored}
    sites = tuple({f"{checkpoint_name(name).rpartition('.')[0]}." for name in experts})  # their per-expert tensors
    report.unused = sorted(t for t in ckpt.tensors if t not in stored and t.rpartition(".")[0] not in quantized
                           and not t.startswith(sites))
    return report


def assign_parameter(p: torch.nn.Parameter, value: torch.Tensor) -> None:
    """``p = value``; a ZeRO-3 partitioned parameter is gathered, set on every rank (each read the same file) and
    partitioned again."""
    if hasattr(p, "ds_id"):
        import deepspeed

        # every rank sets the same value; rank 0's is broadcast and partitioned again on exit (modifier_rank None
        # would drop the change)
        with deepspeed.zero.GatheredParameters([p], modifier_rank=0), torch.no_grad():
            p.copy_(value.to(p.dtype))
        return
    with torch.no_grad():
        p.copy_(value.to(p.dtype))
