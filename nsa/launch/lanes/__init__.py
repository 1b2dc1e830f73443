"""The A/B lanes grid (``python lanes/ab_grid.py``): a base profile x named lane overrides, one Ray Tune trial
per lane, each fitting the pipeline's own TorchTrainer (``nsa.launch.builder``). One module per job:

    schema     the lanes file: Lane, LaneError, load_lanes, select_lanes
    configs    config layering of one lane (profile < env < defaults < flags < lane < key=value < grid)
    plan       GridPlan: every lane resolved and validated in the driver before Ray starts; skips and refusals
    effective  a lane's effective config (no-op fields on the base's device normalised) and requirements
    resources  what a lane holds and how many lanes fit at once
    records    a lane's verdict from its run dir (lane_record) and its heartbeats
    watchdog   hang verdicts and fit() under watch
    tracking   MLflow tags, the final run status of every lane, loss/memory histories, the parent summary run
    tuner      the Tune trial (with the repeat run and checks) and driver, "lane k of n", the lane records
    checks     the deterministic lane's step-by-step loss comparison, the prefill-vs-decode logits check
    report     lanes ranked against the baseline, lanes_summary.{json,md}
    plots      loss vs step of all lanes, tokens/s bars (matplotlib Agg)
    cli        the command line (``main``) and run_grid

Details: lanes/README.md.
"""
