"""The A/B lanes grid (``python lanes/ab_grid.py``): a base profile x named lane overrides, one Ray Tune trial
per lane, each fitting the pipeline's own TorchTrainer (``nsa.launch.builder``). One module per job:

    schema     the lanes file: Lane, LaneError, load_lanes, select_lanes
    configs    config layering of one lane (profile < env < defaults < flags < lane < key=value < grid)
    plan       GridPlan: every lane resolved and validated in the driver before Ray starts
    resources  what a lane holds and how many lanes fit at once
    records    a lane's verdict from its run dir (lane_record) and its heartbeats
    watchdog   hang verdicts and fit() under watch
    tracking   MLflow tags and the final run status of every lane
    tuner      the Tune trial and driver, and the collection of lane records
    report     the summary table and lanes_summary.{json,md}
    cli        the command line (``main``) and run_grid

Details: lanes/README.md.
"""
