"""Reading ds_config files and turning every problem into one `ConfigError`."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from .checks import SECTION, cross_check, salvage_section, top_level_warnings, trainer_autos, validate_section
from .problems import ConfigError, Problem
from .schema import PrecisionConfig

log = logging.getLogger("ds_nvfp4")


class UnreadableConfig(OSError):
    """The file could not be read at all (missing, a directory, no permission)."""


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict:
    seen: dict[str, Any] = {}
    for k, v in pairs:
        if k in seen:
            raise ValueError(f"duplicate key {k!r}")
        seen[k] = v
    return seen


def read_json(path: str | Path) -> dict:
    """Parse a ds_config file. Raises UnreadableConfig, or ConfigError for syntax errors (line and column)."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise UnreadableConfig(f"{path}: cannot read: {exc.strerror or exc}") from exc
    try:
        data = json.loads(text, object_pairs_hook=_no_duplicates)
    except json.JSONDecodeError as exc:
        raise ConfigError([Problem("(json)", f"syntax error at line {exc.lineno} column {exc.colno}: {exc.msg}")],
                          str(path)) from None
    except ValueError as exc:  # duplicate key: DeepSpeed's own loader rejects these too
        raise ConfigError([Problem("(json)", str(exc))], str(path)) from None
    if not isinstance(data, dict):
        raise ConfigError([Problem("(json)", "the top level of a ds_config must be a JSON object")], str(path))
    return data


def check_config(ds: dict, *, deepspeed_checks: bool = False) -> tuple[PrecisionConfig | None, list[Problem]]:
    """All problems of one ds_config dict: errors and warnings. The model is None when the section is invalid."""
    problems = top_level_warnings(ds)
    pc, section_problems = validate_section(ds.get(SECTION, {}))
    problems += section_problems
    if pc is not None:
        problems += cross_check(ds, pc)
    else:  # still report the cross-checks that do not involve an invalid value
        partial, removed = salvage_section(ds.get(SECTION, {}))
        if partial is not None:
            problems += [q for q in cross_check(ds, partial)
                         if not any(q.path.startswith(r) or r in q.message for r in removed)]
    filled, auto_problems = trainer_autos(ds)
    problems += auto_problems
    if deepspeed_checks:
        from .deepspeed_checks import deepspeed_problems

        problems += deepspeed_problems(filled)
    return pc, problems


def load_config(source: str | Path | dict, *, deepspeed_checks: bool = False) -> tuple[dict, PrecisionConfig]:
    """Read and validate a ds_config (a path or a dict).

    Returns:
        ``(ds_dict, precision)``: the whole dict (untouched) and the validated ``precision`` section (defaults
        when the section is absent: NVFP4 disabled).
    Raises:
        ConfigError: with every error found (warnings are logged, not raised).
        UnreadableConfig: the path cannot be read.
    """
    name = None if isinstance(source, dict) else str(source)
    ds = source if isinstance(source, dict) else read_json(source)
    pc, problems = check_config(ds, deepspeed_checks=deepspeed_checks)
    for p in problems:
        if p.severity == "warning":
            log.warning("ds_nvfp4: %s", p.format(name))
    errors = [p for p in problems if p.severity == "error"]
    if errors or pc is None:
        raise ConfigError(errors, name)
    return ds, pc


def with_overrides(ds: dict, overrides: dict[str, Any]) -> dict:
    """``ds`` with dotted-key overrides set in place (``{"precision.communication.all_gather": "nvfp4"}``), missing
    sections created; returns ``ds``. For scripts that derive one configuration from a preset."""
    for key, value in overrides.items():
        node = ds
        *path, last = key.split(".")
        for part in path:
            node = node.setdefault(part, {})
        node[last] = value
    return ds
