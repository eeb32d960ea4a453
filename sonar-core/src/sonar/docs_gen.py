"""The command shared by Sonar's generated documents: rewrite the file, or check it is current."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable


def generated_doc_main(
    render: Callable[[], str], default_output: Path, module: str, description: str, argv: list[str] | None = None
) -> int:
    """``python -m <module>`` writes ``render()`` to the document; ``--check`` exits 1 when the
    committed file differs from it."""
    cli = argparse.ArgumentParser(description=description)
    cli.add_argument("--output", type=Path, default=default_output)
    cli.add_argument("--check", action="store_true", help="exit 1 if the file is not up to date")
    args = cli.parse_args(argv)
    text = render()
    if args.check:
        current = args.output.read_text() if args.output.exists() else ""
        if current != text:
            print(f"{args.output} is stale: run python -m {module}", file=sys.stderr)
            return 1
        return 0
    args.output.write_text(text)
    print(f"wrote {args.output}")
    return 0
