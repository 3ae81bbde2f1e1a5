"""A child process for the import-weight tests: `python test/import_probe.py MODULE HEAVY...` imports
MODULE in a fresh interpreter and fails (exit 1, naming them) if any HEAVY module came with it."""

from __future__ import annotations

import importlib
import sys


def main(argv: list[str]) -> int:
    module, *heavy = argv
    importlib.import_module(module)
    loaded = [m for m in heavy if m in sys.modules]
    if loaded:
        print(f"importing {module} also imported {loaded}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
