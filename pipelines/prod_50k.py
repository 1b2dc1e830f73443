#!/usr/bin/env python
"""The production run: 125M NSA TinyLM, seq 2048, bf16, gradient checkpointing, 50k steps, DDP on GPUs.

    ray job submit --working-dir . -- python pipelines/prod_50k.py             # on a Ray cluster
    ray job submit --working-dir . -- python pipelines/prod_50k.py logging.root=/shared/runs \\
        data.path=/shared/fineweb_edu logging.name=prod-1                     # resumable by name
    python pipelines/prod_50k.py runtime.num_workers=1                        # local GPU box, local Ray

Under `ray job submit` (RAY_ADDRESS set) it connects to the cluster; otherwise it starts a local Ray
instance. runtime.num_workers=-1 (the profile's value) = one worker per GPU of runtime.gpus (16); on a
cluster with fewer GPUs the driver asks the autoscaler for them and waits up to runtime.gpu_wait_seconds
(cluster/README.md, "Cold start"). Before any worker starts it checks the config, the data path
(data/fineweb_edu by default: prepare it with pipelines/prepare_data.py --source hub|jsonl --out ...; the
offline Python-source corpus of a plain prepare_data.py is data.path=data/offline_python), any
checkpoint to resume, and that the requested GPUs/CPUs fit the cluster. Relative paths (runs,
data/fineweb_edu) resolve against runtime.storage_root ($NSA_STORAGE_ROOT: /mnt/shared on the cluster
configs); a job never writes into Ray's working-dir copy (refused, naming the field). Same exit codes as
train.py.
"""
from __future__ import annotations

from nsa.launch.entry import run_train

DEFAULT_PROFILE = "pipelines/configs/prod_50k.yaml"

if __name__ == "__main__":
    run_train("prod_50k", __doc__, DEFAULT_PROFILE, prefix="prod50k")
