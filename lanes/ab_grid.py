#!/usr/bin/env python
"""A/B lanes as one Ray Tune grid (see lanes/README.md; the logic lives in nsa/launch/lanes/).

    python lanes/ab_grid.py                                   # the default lanes of lanes/lanes.yaml
    python lanes/ab_grid.py --only baseline,conservative --steps 20 train.lr=1e-3
    python lanes/ab_grid.py --list                            # the lanes and why each exists
"""
from __future__ import annotations

import sys

from nsa.launch.lanes.cli import main

if __name__ == "__main__":
    sys.exit(main())
