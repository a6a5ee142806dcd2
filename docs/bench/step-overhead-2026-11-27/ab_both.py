"""Both of this session's cuts together (``ab_overhead.py``'s and ``ab_forward.py``'s pieces patched back in as old)
against the code before them, interleaved in one process. Usage: python ab_both.py FIRST LAST [MODEL]."""

from __future__ import annotations

import sys

import ab_forward
import ab_overhead

if __name__ == "__main__":
    ab_overhead.run(ab_overhead.OLD | ab_forward.OLD, int(sys.argv[1]), int(sys.argv[2]), *sys.argv[3:4])
