"""One problem found in a config, and the exception that carries all of them."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Literal


@dataclass(frozen=True)
class Problem:
    """``path`` is a dotted JSON path (``precision.weights.storage``); ``allowed`` lists accepted values; ``code``
    names a kind of problem a tool may treat specially (``"near-miss"``: an unknown top-level key that looks like a
    known one, a warning at start-up and an error for ``ds-nvfp4 validate`` unless ``--allow-unknown``)."""

    path: str
    message: str
    allowed: tuple[str, ...] = ()
    severity: Literal["error", "warning", "note"] = "error"
    code: str = ""

    def format(self, source: str | None = None) -> str:
        text = f"{self.path}: {self.message}"
        if self.allowed:
            text += f" (allowed: {', '.join(self.allowed)})"
        if self.severity != "error":
            text = f"{self.severity}: {text}"
        return f"{source}: {text}" if source else text

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class ConfigError(ValueError):
    """Every error found in one config (warnings are not errors and are not carried here)."""

    problems: list[Problem] = field(default_factory=list)
    source: str | None = None

    def __str__(self) -> str:
        lines = [p.format(self.source) for p in self.problems]
        head = f"{len(lines)} problem(s) in the ds_config" + (f" {self.source}" if self.source else "")
        return head + ":\n  " + "\n  ".join(lines)
