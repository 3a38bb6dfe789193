"""The JSON result of a benchmark: printed, and written to `--json` when given."""

from __future__ import annotations

import argparse
import json
from typing import Any


def emit(result: dict[str, Any], args: argparse.Namespace) -> int:
    """Print `result` as indented JSON and write it to `args.json` (a Path, or None: print only); 0."""
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text + "\n")
    return 0
