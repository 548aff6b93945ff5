#!/usr/bin/env python3
"""Merge phase_trace_rank*.jsonl files into Chrome Trace Event JSON for Perfetto or chrome://tracing.

Usage: scripts/phase_trace_to_chrome.py TRACE_DIR -o trace.json [--gzip] [--group-by role|host]
Same as `libra trace convert`; the logic lives in libra/observability/trace_convert.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

try:
    from libra.observability.trace_convert import main
except ModuleNotFoundError:  # run from a checkout without the package installed
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from libra.observability.trace_convert import main

if __name__ == "__main__":
    sys.exit(main())
