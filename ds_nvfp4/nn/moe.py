"""Mixture-of-Experts structure, found by what the modules are, never by their attribute names.

An *expert weight* is a parameter that holds several experts' GEMM matrices: a floating 3-D parameter ``[E, a, b]``
(any module but a convolution), or a 2-D parameter ``[E*a, b]`` with the experts stacked along dim 0 (DBRX) when a
router of ``E`` outputs sits beside it. A *router* is the GEMM that produces an MoE block's routing logits: a matrix
``[E, H]`` (an ``nn.Linear`` of ``E`` outputs, or any module whose only matrix it is) in the block that also holds
``E`` experts over a hidden size ``H``, outside the experts. A *list of experts* is an ``nn.ModuleList`` of ``E >= 2``
same-type modules with Linears inside, beside such a router. Nothing here depends on how a family names things; the
checks are shapes, module types and where modules sit in the tree.

Each experts module found is an :class:`ExpertsSite`: its weights, how ds_nvfp4 runs them (``execution``), its
router and the module ZeRO-3 must treat as a leaf. ``execution`` is

* ``"interface"``: the module follows transformers' experts interface (the attributes ``use_experts_implementation``
  sets: ``has_gate``, ``has_bias``, ``is_transposed``, ``is_concatenated``, ``has_post_expert_norm``, and the
  projections that interface's implementations read), so its forward is the interface's, run as grouped FP4 GEMMs
  (nn/experts.py);
* ``"intercepted"``: any other module with expert weights (Llama 4's ``torch.bmm``, DBRX's per-expert ``matmul``):
  its own forward runs, and every GEMM whose weight operand is a slice of an expert weight runs in FP4
  (nn/intercept.py), checked at the first forward;
* ``"linears"``: a list of per-expert modules, whose Linears convert as any Linear.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

#: attributes transformers' ``use_experts_implementation`` gives an experts class (transformers >= 5); later releases
#: add ``is_concatenated`` and ``has_post_expert_norm``, read with their defaults (True, False) where absent
INTERFACE_FLAGS = ("has_gate", "has_bias", "is_transposed")
#: module types whose parameters are never expert weights (3-D convolution kernels, embedding tables, norms)
_NOT_EXPERTS = (nn.modules.conv._ConvNd, nn.Embedding, nn.EmbeddingBag, nn.LayerNorm, nn.GroupNorm,
                nn.modules.batchnorm._BatchNorm)


def shape_of(p: torch.Tensor) -> tuple[int, ...]:
    """The full shape, also of a ZeRO-3 partitioned parameter (whose local shape is empty)."""
    return tuple(getattr(p, "ds_shape", p.shape))


@dataclass(frozen=True)
class ExpertWeight:
    """One parameter holding ``experts`` matrices of ``rows x cols`` each (in its stored layout)."""

    param: str          #: dotted name relative to the experts module ("gate_up_proj", "mlp.w1")
    experts: int
    rows: int
    cols: int
    stacked: bool = False  #: a 2-D parameter ``[experts*rows, cols]``

    @property
    def shape(self) -> tuple[int, int, int]:
        """``(E, rows, cols)``: the stored layout as one matrix per expert."""
        return self.experts, self.rows, self.cols


@dataclass
class ExpertsSite:
    """An experts module: where its expert weights are and how ds_nvfp4 runs them."""

    name: str                       #: the experts module's dotted name
    experts: int
    execution: str                  #: "interface", "intercepted" or "linears"
    weights: list[ExpertWeight] = field(default_factory=list)
    members: list[str] = field(default_factory=list)  #: "linears": the per-expert modules' dotted names
    router: str | None = None       #: the router's dotted name, None when none was found
    leaf: str = ""                  #: the module ZeRO-3 gathers whole (the experts module; the block for lists)
    hidden: int | None = None       #: H, the hidden size the router reads
    #: how the router was found: "traced" (its output reaches the block's top-k, nn/moe.py:trace_routers) or "shape"
    router_by: str = "shape"

    def describe(self) -> str:
        how = {"interface": "grouped FP4 GEMMs (transformers' experts interface)",
               "intercepted": "its own forward, each GEMM on an expert slice in FP4 (checked at the first forward)",
               "linears": "one Linear per expert and projection"}[self.execution]
        found = {"traced": "its output feeds the top-k", "shape": "an [E, H] GEMM beside the experts"}[self.router_by]
        return (f"{self.name}: {self.experts} experts, {how}; router "
                + (f"{self.router} ({found})" if self.router else "not found"))


@dataclass
class MoEStructure:
    """Every experts module and router of a model."""

    sites: list[ExpertsSite] = field(default_factory=list)
    #: router module name -> the experts module it routes for
    routers: dict[str, str] = field(default_factory=dict)
    #: 3-D parameters (outside convolutions) that look like expert weights but have no router of E outputs:
    #: ``"<module>.<param>"`` -> why they are not treated as experts
    unexplained: dict[str, str] = field(default_factory=dict)

    def site_of(self, module_name: str) -> ExpertsSite | None:
        return next((s for s in self.sites if s.name == module_name), None)

    @property
    def list_members(self) -> set[str]:
        return {m for s in self.sites for m in s.members}


def _matrices(m: nn.Module) -> list[tuple[str, tuple[int, ...]]]:
    """The module's own floating parameters of 2 or more dimensions: ``(name, full shape)``."""
    return [(n, shape_of(p)) for n, p in m.named_parameters(recurse=False)
            if p.is_floating_point() and len(shape_of(p)) >= 2]


def _router_weight(m: nn.Module) -> tuple[int, int] | None:
    """``(E, H)`` when ``m`` is a single-matrix module (a Linear, or a module whose only matrix is ``[E, H]``)."""
    mats = _matrices(m)
    if len(mats) != 1 or len(mats[0][1]) != 2 or isinstance(m, _NOT_EXPERTS):
        return None
    return mats[0][1]  # type: ignore[return-value]


def _ancestors(name: str) -> list[str]:
    """``"a.b.c"`` -> ``["a.b", "a", ""]``."""
    parts = name.split(".") if name else []
    return [".".join(parts[:i]) for i in range(len(parts) - 1, -1, -1)]


def _inside(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".") if prefix else True


def _find_router(modules: dict[str, nn.Module], site: str, experts: int, hidden: set[int],
                 levels: int = 3) -> tuple[str, str, int] | None:
    """``(router name, MoE block name, H)``: the nearest single-matrix ``[E, H]`` module (``H`` in ``hidden``)
    under an ancestor of ``site`` (up to ``levels`` up), outside ``site``; nested MLPs (modules with several
    matrices) are not searched, so a shared expert is never taken for the router."""
    for block in _ancestors(site)[:levels]:
        found = []
        for name, m in modules.items():
            if not _inside(name, block) or _inside(name, site) or name == block:
                continue
            shape = _router_weight(m)
            if shape is None or shape[0] != experts or shape[1] not in hidden:
                continue
            parent = name.rsplit(".", 1)[0] if "." in name else ""
            # one Linear of a multi-matrix MLP inside the block (a shared expert) is never the router
            if parent != block and len([n for n, c in modules[parent].named_modules() if _matrices(c)]) > 1:
                continue
            found.append((name, shape[1]))
        if found:
            name, h = found[0]
            return name, block, h
    return None


def _follows_interface(m: nn.Module, names: set[str]) -> bool:
    """Whether ``m``'s forward is transformers' experts-interface dispatcher (a class decorated by
    ``use_experts_implementation`` that does not override ``forward``; a subclass that adds work around it, as
    Ergo's per-expert norm, is not) or a module that declares the interface's semantics
    (``ds_nvfp4_experts_interface = True``, as the reference GPT's experts), with the interface's attributes and
    the projections its implementations read (``gate_up_proj`` or ``up_proj``, ``down_proj``, their ``*_bias``
    when ``has_bias``, ``num_experts``)."""
    code = getattr(type(m).forward, "__code__", None)
    dispatcher = code is not None and code.co_filename.replace("\\", "/").endswith("transformers/integrations/moe.py")
    if not (dispatcher or getattr(type(m), "ds_nvfp4_experts_interface", False)):
        return False
    if not all(hasattr(m, f) for f in INTERFACE_FLAGS) or not hasattr(m, "num_experts"):
        return False
    first = "gate_up_proj" if m.has_gate else "up_proj"
    need = {first, "down_proj"} | ({f"{first}_bias", "down_proj_bias"} if m.has_bias else set())
    return need <= names and (m.has_gate or hasattr(m, "act_fn"))


#: the functions that pick experts: a GEMM whose output reaches one of them is a routing GEMM
_SELECTORS = {torch.topk, torch.Tensor.topk, torch.sort, torch.Tensor.sort, torch.argsort, torch.Tensor.argsort,
              torch.argmax, torch.Tensor.argmax, torch.kthvalue}
#: ``max`` picks too when it reduces along a dim (PhiMoE's sparsemixer); a plain ``max()`` is a reduction
_MAX = {torch.max, torch.Tensor.max}


class _RoutingTrace(TorchFunctionMode):
    """Follows which GEMM modules' outputs reach an expert-selecting function (data flow, through any op)."""

    def __init__(self) -> None:
        super().__init__()
        self.sources: dict[int, frozenset[str]] = {}
        self.alive: list[torch.Tensor] = []  # keeps traced tensors alive, so their ids stay unique
        self.routers: set[str] = set()

    def tag(self, out, name: str) -> None:
        for t in _flat(out):
            self.sources[id(t)] = frozenset({name})
            self.alive.append(t)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        srcs = frozenset().union(*(self.sources.get(id(t), frozenset()) for t in _flat((args, kwargs))))
        if srcs:
            if func in _SELECTORS or (func in _MAX and (len(args) > 1 or "dim" in kwargs)):
                self.routers |= srcs
            for t in _flat(out):
                self.sources[id(t)] = self.sources.get(id(t), frozenset()) | srcs
                self.alive.append(t)
        return out


def _flat(obj) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _flat(o)]
    return []


def trace_routers(block: nn.Module, experts: list[nn.Module], hidden: int) -> set[str] | None:
    """The single-matrix GEMM modules of an MoE ``block`` whose outputs reach a top-k / sort / argmax: the routers
    by role (names relative to ``block``). The block runs once on the meta device (no data, no memory, also with
    ZeRO-3 partitioned parameters), its ``experts`` modules stubbed out (their loops depend on data). None when the
    block cannot run that way (callers fall back to the router's shape)."""
    from torch.func import functional_call

    params = {n: torch.empty(shape_of(p), dtype=p.dtype, device="meta") for n, p in block.named_parameters()}
    buffers = {n: torch.empty(b.shape, dtype=b.dtype, device="meta") for n, b in block.named_buffers()}
    dtype = next((p.dtype for p in params.values() if p.is_floating_point()), torch.float32)
    trace = _RoutingTrace()
    for n, m in block.named_modules():  # the matrix of every single-matrix module is a source of the data flow
        if n and _router_weight(m) is not None:
            pname = next(pn for pn, _ in _matrices(m))
            trace.tag(params[f"{n}.{pname}"], n)
    saved = [(m, m.__dict__.get("forward")) for m in experts]
    for m in experts:
        m.forward = lambda x, *a, **k: torch.zeros_like(x)
    try:
        for shape in ((2, 8, hidden), (16, hidden)):
            try:
                with trace:
                    functional_call(block, {**params, **buffers}, (torch.empty(shape, dtype=dtype, device="meta"),))
                return trace.routers
            except Exception:  # this input rank does not fit the block: try the other, then give up
                trace.routers.clear()
        return None
    finally:
        for m, fwd in saved:
            if fwd is None:
                del m.forward
            else:
                m.forward = fwd


def find_moe(model: nn.Module) -> MoEStructure:
    """The experts modules and routers of ``model`` (see the module docstring), for ``convert_model`` and the
    ZeRO-3 leaf marking. Works on ZeRO-3 partitioned parameters (reads ``ds_shape``)."""
    modules = dict(model.named_modules())
    out = MoEStructure()
    taken: set[str] = set()

    # 1. 3-D expert weights; the experts module is the outermost module below the MoE block that holds them
    owners: dict[str, list[tuple[str, tuple[int, ...]]]] = {}
    for name, m in modules.items():
        if isinstance(m, _NOT_EXPERTS):
            continue
        three = [(n, s) for n, s in _matrices(m) if len(s) == 3 and s[0] >= 2]
        if three:
            owners[name] = three
    for owner, params in owners.items():
        by_e: dict[int, list] = {}
        for n, s in params:
            by_e.setdefault(s[0], []).append((n, s))
        for e, group in by_e.items():
            hidden = {d for _, s in group for d in s[1:]}
            found = _find_router(modules, owner, e, hidden)
            m = modules[owner]
            own = {n for n, _ in m.named_parameters(recurse=False)}
            if found is None and not _follows_interface(m, own):
                for n, s in group:
                    out.unexplained[f"{owner}.{n}" if owner else n] = (
                        f"3-D parameter {list(s)} with no router of {e} outputs beside it and not transformers' "
                        "experts interface: not known to be experts")
                continue
            router, block, h = found if found else (None, _ancestors(owner)[0] if owner else "", None)
            site_name = owner
            # DBRX-like nesting: the module the block calls is the child of the block that holds the owner
            if found and block != owner:
                site_name = ".".join(owner.split(".")[:len(block.split(".")) + (1 if block else 0)]) or owner
            interface = site_name == owner and _follows_interface(m, own)
            prefix = owner[len(site_name) + 1:] + "." if owner != site_name else ""
            site = out.site_of(site_name)
            if site is None:
                site = ExpertsSite(site_name, e, "interface" if interface else "intercepted", router=router,
                                   leaf=site_name, hidden=h)
                out.sites.append(site)
            site.weights += [ExpertWeight(prefix + n, e, s[1], s[2]) for n, s in group]
            if router:
                out.routers[router] = site_name
            taken.add(owner)

    # 2. 2-D parameters of non-GEMM modules with the experts stacked along dim 0 (DBRX's w1 / v1 / w2)
    for name, m in modules.items():
        if name in taken or isinstance(m, (nn.Linear, *_NOT_EXPERTS)) or _router_weight(m) is not None:
            continue
        two = [(n, s) for n, s in _matrices(m) if len(s) == 2]
        if not two:
            continue
        for e in sorted({r for r in _candidate_router_widths(modules, name)}, reverse=True):
            group = [(n, s) for n, s in two if s[0] % e == 0 and s[0] // e >= 1]
            found = _find_router(modules, name, e, {s[1] for _, s in group}) if group else None
            if not found:
                continue
            router, block, h = found
            group = [(n, s) for n, s in group if s[1] == h]
            site_name = ".".join(name.split(".")[:len(block.split(".")) + (1 if block else 0)]) or name
            prefix = name[len(site_name) + 1:] + "." if name != site_name else ""
            site = out.site_of(site_name)
            if site is None:
                site = ExpertsSite(site_name, e, "intercepted", router=router, leaf=site_name, hidden=h)
                out.sites.append(site)
            site.weights += [ExpertWeight(prefix + n, e, s[0] // e, s[1], stacked=True) for n, s in group]
            out.routers[router] = site_name
            taken.add(name)
            break

    # 3. lists of per-expert modules beside a router of as many outputs
    for name, m in modules.items():
        if not isinstance(m, nn.ModuleList) or len(m) < 2 or len({type(c) for c in m}) != 1:
            continue
        if not any(isinstance(c, nn.Linear) for c in m[0].modules()):
            continue
        linear_in = {c.in_features for c in m[0].modules() if isinstance(c, nn.Linear)}
        found = _find_router(modules, name, len(m), linear_in, levels=1)
        if not found:
            continue
        router, block, h = found
        members = [f"{name}.{i}" for i in range(len(m))]
        out.sites.append(ExpertsSite(name, len(m), "linears", members=members, router=router, leaf=block, hidden=h))
        out.routers[router] = name
    _routers_by_role(model, modules, out)
    return out


def _routers_by_role(model: nn.Module, modules: dict[str, nn.Module], out: MoEStructure) -> None:
    """Replace each site's router found by shape with the GEMMs that really feed its top-k (``trace_routers``),
    where the MoE block runs on the meta device; the shape rule stays where it cannot."""
    by_block: dict[str, list[ExpertsSite]] = {}
    for site in out.sites:
        block = site.leaf if site.execution == "linears" else (_ancestors(site.name) or [""])[0]
        by_block.setdefault(block, []).append(site)
    for block, sites in by_block.items():
        if block == "" and modules[""] is model and len(out.sites) > 1:
            continue  # the whole model is no MoE block
        hidden = sites[0].hidden or next((d for w in sites[0].weights for d in (w.cols, w.rows)), None)
        if hidden is None:
            continue
        stubs = [modules[s.name] for s in sites if s.execution != "linears"] or \
                [modules[m] for s in sites for m in s.members]
        traced = trace_routers(modules[block], stubs, hidden)
        if not traced:  # the block cannot run on meta, or picks experts by a function not watched: by shape
            continue
        for s in sites:
            if s.router is not None:
                out.routers.pop(s.router, None)
        names = sorted(f"{block}.{n}" if block else n for n in traced)
        for s in sites:
            s.router = ", ".join(names) or None
            s.router_by = "traced"
        for n in names:
            out.routers[n] = sites[0].name


def _candidate_router_widths(modules: dict[str, nn.Module], name: str, levels: int = 3) -> set[int]:
    """The output widths ``E >= 2`` of single-matrix modules near ``name`` (under its nearest ancestors)."""
    widths: set[int] = set()
    for block in _ancestors(name)[:levels]:
        for other, m in modules.items():
            if _inside(other, block) and not _inside(other, name):
                shape = _router_weight(m)
                if shape is not None and shape[0] >= 2:
                    widths.add(shape[0])
        if widths:
            break
    return widths
