"""`ds-nvfp4 schema`: the JSON Schema of the precision section (for editors and CI)."""

from __future__ import annotations

import argparse
import json


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("schema", help="print the JSON Schema of the precision section")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..config import PrecisionConfig

    schema = PrecisionConfig.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "ds_config precision section (ds-nvfp4)"
    print(json.dumps(schema, indent=2))
    return 0
