"""The ``precision`` ds_config section: schema, validation, cross-checks (no DeepSpeed import needed)."""

from .load import UnreadableConfig, check_config, load_config, read_json, with_overrides
from .problems import ConfigError, Problem
from .schema import PrecisionConfig

__all__ = ["ConfigError", "PrecisionConfig", "Problem", "UnreadableConfig", "check_config", "load_config",
           "read_json", "with_overrides"]
