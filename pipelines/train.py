#!/usr/bin/env python
"""Train an NSA TinyLM with Ray Train.

    python pipelines/train.py                                    # tiny CPU profile: 2 workers, a few minutes
    python pipelines/train.py train.steps=100 runtime.num_workers=1
    python pipelines/train.py --config pipelines/configs/prod_50k.yaml
    python pipelines/train.py logging.name=<run> ...             # resume that run from its last checkpoint
    ray job submit --working-dir . -- python pipelines/train.py  # on a running Ray cluster

Prints the resolved config (with the source of every value) once, progress lines from rank 0, and at the
end the run directory, final/val loss and the `mlflow ui` command. Exit codes: 0 done (or halted on
request), 1 training failed / non-finite halt, 2 bad input (config, data, checkpoint).
"""
from __future__ import annotations

from nsa.launch.entry import run_train

DEFAULT_PROFILE = "pipelines/configs/tiny_cpu.yaml"

if __name__ == "__main__":
    run_train("train", __doc__, DEFAULT_PROFILE, prefix="train")
