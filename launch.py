#!/usr/bin/env python3
"""rollart_hpc launcher: dispatches to `rollart_hpc.entry.cli` (run, submit, resume, bench, report, ...)."""

import sys

from rollart_hpc.entry.cli import main

if __name__ == "__main__":
    sys.exit(main())
