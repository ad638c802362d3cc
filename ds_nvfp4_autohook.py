"""Make ``deepspeed.initialize`` honour the ``precision`` section, with no change to the user's script.

Installed by ``ds_nvfp4_autohook.pth`` (site-packages), which Python runs at interpreter start. This module must
stay light: it imports only the standard library, and does nothing until ``deepspeed`` itself is imported. Then
it replaces the module attribute ``deepspeed.initialize`` with :func:`initialize`, which

* calls DeepSpeed's own ``initialize`` unchanged when the ds_config has no ``precision`` key (plain DeepSpeed:
  the only cost is reading the config's top-level keys, which DeepSpeed reads anyway);
* otherwise hands the call to ``ds_nvfp4.initialize`` (which validates the section, raising ``ConfigError`` when it
  cannot be applied, and calls DeepSpeed's original ``initialize``; see :func:`original_initialize`).

Opt out with ``DS_NVFP4_AUTO=0`` in the environment (read at interpreter start and again at the call).
"""

from __future__ import annotations

# Only os and sys (already loaded by the interpreter): this module is imported at every interpreter start, so
# importlib.abc (13 ms), json and typing are avoided; the finder and loader follow the protocols by duck typing.
import os
import sys

#: attribute of the wrapper holding DeepSpeed's own ``initialize``
ORIGINAL_ATTR = "__ds_nvfp4_original__"


def enabled() -> bool:
    return os.environ.get("DS_NVFP4_AUTO", "1").strip().lower() not in ("0", "false", "no", "off")


def original_initialize(deepspeed_module: object):
    """DeepSpeed's own ``initialize``, whether or not the hook wrapped it (``ds_nvfp4.initialize`` calls this)."""
    fn = deepspeed_module.initialize
    return getattr(fn, ORIGINAL_ATTR, fn)


#: the ds_config section ds_nvfp4 reads
SECTION = "precision"


def config_source(arguments: dict) -> tuple[str | None, object]:
    """Which argument of a bound ``deepspeed.initialize`` call holds the ds_config, and its value, as DeepSpeed
    resolves it: ``config``, then ``config_params``, then ``args.deepspeed_config``. ``(None, None)`` when none
    does. The one place ds_nvfp4 encodes this precedence (the hook and ``ds_nvfp4.initialize`` both call it)."""
    for key in ("config", "config_params"):
        if arguments.get(key) is not None:
            return key, arguments[key]
    path = getattr(arguments.get("args"), "deepspeed_config", None)
    return ("args", path) if path is not None else (None, None)


def bind(function, args: tuple, kwargs: dict) -> dict | None:
    """The call's arguments by parameter name (``args`` may come positionally or by keyword), or None when the
    call does not fit ``function``'s signature (DeepSpeed then raises its own error)."""
    import inspect

    try:
        return dict(inspect.signature(function).bind(*args, **kwargs).arguments)
    except TypeError:
        return None


def near_misses(keys) -> list[str]:
    """Top-level keys that look like a misspelt ``precision`` (``precison``, ``Precision``, ``precision_config``):
    DeepSpeed ignores unknown keys, so such a config would train plain BF16 without a word."""
    import difflib

    out = []
    for key in keys:
        if not isinstance(key, str) or key == SECTION:
            continue
        norm = key.strip().lower().replace("-", "_")
        if norm.startswith(SECTION) or norm.endswith(SECTION) or \
                difflib.SequenceMatcher(None, norm, SECTION).ratio() >= 0.8:
            out.append(key)
    return out


def _top_level_keys(source: object) -> list:
    if isinstance(source, dict):
        return list(source)
    if isinstance(source, (str, os.PathLike)):
        import json

        try:
            with open(source) as fh:
                data = json.load(fh)
        except (OSError, ValueError):
            return []
        return list(data) if isinstance(data, dict) else []
    return []


def launcher_rank() -> int:
    """This process's rank as the launcher set it (before ``torch.distributed`` exists): RANK, else Open MPI's,
    PMI's or SLURM's variable; 0 when none is set."""
    for name in ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"):
        value = os.environ.get(name, "").strip()
        if value.isdigit():
            return int(value)
    return 0


def warn_near_miss(source: object) -> list[str]:
    """Say loudly (rank 0, stderr) that a ds_config without ``precision`` has a near miss of it; returns them."""
    found = near_misses(_top_level_keys(source))
    if found and launcher_rank() == 0:
        names = ", ".join(repr(k) for k in found)
        print(f"ds_nvfp4: WARNING: the ds_config has no {SECTION!r} section but has {names}: DeepSpeed ignores unknown "
              f"keys, so this run trains WITHOUT NVFP4 (plain DeepSpeed precision). Rename it to {SECTION!r} to train "
              "NVFP4; `ds-nvfp4 validate` reports it too.", file=sys.stderr, flush=True)
    return found


def has_precision_section(source: object) -> bool:
    """Whether a ds_config (dict or path) has a top-level ``precision`` key. An unreadable path is left to
    DeepSpeed (which raises its own error) unless the text mentions the key, in which case ds_nvfp4 reports it."""
    if isinstance(source, dict):
        return SECTION in source
    if isinstance(source, (str, os.PathLike)):
        try:
            with open(source) as fh:
                text = fh.read()
        except OSError:
            return False
        if '"precision"' not in text:
            return False
        import json

        try:
            data = json.loads(text)
        except ValueError:
            return True  # let ds_nvfp4 report the syntax error with line and column
        return not isinstance(data, dict) or SECTION in data
    return False


def _wrap(deepspeed_module: object) -> None:
    original = deepspeed_module.initialize
    if hasattr(original, ORIGINAL_ATTR):
        return

    def initialize(*args, **kwargs):
        arguments = bind(original, args, kwargs) if enabled() else None
        if arguments is not None:
            _, source = config_source(arguments)
            if has_precision_section(source):
                import ds_nvfp4

                return ds_nvfp4.initialize(*args, **kwargs)
            warn_near_miss(source)
        return original(*args, **kwargs)

    initialize.__doc__ = original.__doc__
    initialize.__name__ = original.__name__
    initialize.__qualname__ = original.__qualname__
    initialize.__wrapped__ = original  # inspect.signature sees DeepSpeed's signature
    setattr(initialize, ORIGINAL_ATTR, original)
    deepspeed_module.initialize = initialize


class _Loader:
    """Runs DeepSpeed's own loader, then wraps ``initialize`` before anyone can read it."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module) -> None:
        self.inner.exec_module(module)
        _wrap(module)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


class _Finder:
    """Finds nothing itself: asks the other finders for ``deepspeed`` and swaps in :class:`_Loader`."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "deepspeed":
            return None
        others = [f for f in sys.meta_path if f is not self]
        for finder in others:
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find else None
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Loader(spec.loader)
                return spec
        return None


def install() -> None:
    """Called by the ``.pth`` file at interpreter start: wrap ``deepspeed.initialize`` when deepspeed loads."""
    if not enabled():
        return
    mod = sys.modules.get("deepspeed")
    if mod is not None and hasattr(mod, "initialize"):
        _wrap(mod)
    elif not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
