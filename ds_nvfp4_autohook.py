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


def _config_source(args: tuple, kwargs: dict) -> object:
    """The ds_config of a ``deepspeed.initialize`` call, as DeepSpeed resolves it: ``config``, then
    ``config_params``, then ``args.deepspeed_config`` (``args`` is the first positional parameter)."""
    for key in ("config", "config_params"):
        if kwargs.get(key) is not None:
            return kwargs[key]
    ns = kwargs.get("args", args[0] if args else None)
    return getattr(ns, "deepspeed_config", None)


def has_precision_section(source: object) -> bool:
    """Whether a ds_config (dict or path) has a top-level ``precision`` key. An unreadable path is left to
    DeepSpeed (which raises its own error) unless the text mentions the key, in which case ds_nvfp4 reports it."""
    if isinstance(source, dict):
        return "precision" in source
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
        return not isinstance(data, dict) or "precision" in data
    return False


def _wrap(deepspeed_module: object) -> None:
    original = deepspeed_module.initialize
    if hasattr(original, ORIGINAL_ATTR):
        return

    def initialize(*args, **kwargs):
        if enabled() and has_precision_section(_config_source(args, kwargs)):
            import ds_nvfp4

            return ds_nvfp4.initialize(*args, **kwargs)
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
