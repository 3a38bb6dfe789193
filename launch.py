#!/usr/bin/env python3
"""rollart_hpc launcher: dispatches to `rollart_hpc.cli` (run, submit, resume, bench, report, ...)."""

import sys

from rollart_hpc.cli import main

if __name__ == "__main__":
    sys.exit(main())
