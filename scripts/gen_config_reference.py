#!/usr/bin/env python
"""Write cluster_manual/configuration_reference.md and cluster_manual/validation.md from the config
dataclasses and the rule table. `--check` writes nothing and exits 1 when a committed file is stale."""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from libra.config.reference import render_reference, render_validation  # noqa: E402

OUTPUTS = {
    "cluster_manual/configuration_reference.md": render_reference,
    "cluster_manual/validation.md": render_validation,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="exit 1 if a generated file is stale; write nothing")
    args = parser.parse_args(argv)
    stale = []
    for rel, render in OUTPUTS.items():
        path = os.path.join(ROOT, rel)
        text = render()
        try:
            with open(path, encoding="utf-8") as fh:
                current = fh.read()
        except FileNotFoundError:
            current = None
        if current == text:
            continue
        if args.check:
            stale.append(rel)
            continue
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(text)
        print(f"wrote {rel}")
    if stale:
        print(f"stale: {', '.join(stale)}; run python scripts/gen_config_reference.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
