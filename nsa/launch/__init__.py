"""The launch layer: what the entry points in ``pipelines/`` and ``lanes/`` share, importable as a package.

    nsa.launch.cli      --config PROFILE + section.key=value parsing, --help key table, UserError, exit codes
    nsa.launch.builder  RunConfig -> validated inputs, run dir, Ray connection, the one TorchTrainer, launch()
    nsa.launch.entry    the training main shared by pipelines/train.py and pipelines/prod_50k.py
    nsa.launch.storage  runtime.storage_root for relative paths; refuses results inside Ray's working-dir copy
    nsa.launch.reaper   ends a private Ray instance with its driver, even one killed by SIGKILL (stdlib only)
    nsa.launch.lanes    the A/B lanes grid behind lanes/ab_grid.py (schema, configs, resources, Tune, MLflow)

Importing ``nsa.launch`` imports nothing heavy; Ray is imported by the functions that need it.
"""
