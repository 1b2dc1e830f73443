#!/usr/bin/env python
"""Log a run's final model to MLflow, register it, and (--promote) move an alias to it if its evaluation wins.

    python pipelines/evaluate.py --checkpoint runs/<run>        # first: the evaluation promotion reads
    python pipelines/promote.py runs/<run>                      # log + register as a version of --name
    python pipelines/promote.py runs/<run> --promote            # ... and take @champion if it beats the holder

The model is the run's latest checkpoint, logged as an MLflow pyfunc model (weights, config, the evaluation
JSON, tokenizer) into the run's MLflow run (else the evaluation's run) and registered in the model registry
of the same store as a version of --name (default: the run's experiment), its tags holding the evaluation.
Running it again for the same checkpoint reuses that version. --promote moves --alias only when the
version's val bits per byte (evaluate.py's first length) is lower than the holder's on the same val split,
length and token budget, and prints why not otherwise.

Exit codes: 0 registered (and promoted when asked), 3 promotion refused (the reason is printed), 2 bad input.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from nsa.launch.cli import UserError, main_entry

EXIT_REFUSED = 3


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="promote.py", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("run", help="run directory (its latest checkpoint is the model)")
    p.add_argument("--name", default=None, help="registered model name (default: the run's experiment)")
    p.add_argument("--promote", action="store_true", help="move --alias to this version if its eval beats the holder")
    p.add_argument("--alias", default="champion", help="registry alias to move (default: %(default)s)")
    p.add_argument("--eval", default=None, help="evaluation JSON (default: <run>/eval/eval_step_<latest step>.json)")
    p.add_argument("--mlflow-uri", default=None, help="tracking URI (default: the run's, else <runs root>/mlflow.db)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from nsa.config import CLI_MLFLOW_ENV, apply_process_env, config_from_dict
    apply_process_env(CLI_MLFLOW_ENV)
    from nsa.evaluation import report
    from nsa.train.checkpoint import load_checkpoint, resolve_checkpoint_file

    if not args.alias or not all(c.isalnum() or c in "_-" for c in args.alias):
        raise UserError(f"--alias={args.alias!r}: use letters, digits, '_' or '-'")
    run_dir = Path(args.run).expanduser()
    if not run_dir.is_dir():
        raise UserError(f"run {str(run_dir)!r} is not a directory: pass a run directory such as runs/<name>")
    f = resolve_checkpoint_file(run_dir)
    state = load_checkpoint(f, map_location="cpu", mmap=True)
    step, cfg = int(state["step"]), config_from_dict(state["config"])
    del state
    eval_json = Path(args.eval) if args.eval else report.eval_paths(run_dir / report.EVAL_DIR, step)[0]
    if not eval_json.is_file():
        raise UserError(f"--eval: no evaluation of step {step} ({eval_json}): run python pipelines/evaluate.py "
                        f"--checkpoint {run_dir} first")
    try:
        results = report.read_eval(eval_json)
    except ValueError as exc:
        raise UserError(f"--eval: {exc}") from None
    if Path(results["checkpoint"]).resolve() != f.resolve():
        raise UserError(f"--eval: {eval_json} evaluates {results['checkpoint']}, not the run's latest checkpoint "
                        f"{f}: evaluate that one (python pipelines/evaluate.py --checkpoint {run_dir})")

    uri, run_id, experiment = report.mlflow_target(run_dir, cfg, args.mlflow_uri)
    ev = results.get("mlflow") or {}
    if run_id is None and ev.get("tracking_uri") == uri:
        run_id = ev.get("run_id")       # no training run in this store: the evaluation's run holds the model
    name = args.name or experiment
    from mlflow import MlflowClient
    from nsa.evaluation import registry
    run = report.EvalRun(uri, experiment, run_id, f"model-{run_dir.name}-step{step}", {"run_dir": str(run_dir)})
    try:
        version, created = registry.log_and_register(uri=uri, run_id=run.run_id, name=name, checkpoint_file=f,
                                                     results=results, eval_json=eval_json, run_dir=run_dir)
    finally:
        run.close()
    print(f"{'registered' if created else 'already registered'}: {name} version {version.version} "
          f"(step {step}, val bits/byte {float(version.tags['val_bpb']):.4f} at {version.tags['eval_length']} tokens, "
          f"run {run.run_id}, {uri})")
    if not args.promote:
        return 0
    client = MlflowClient(uri)
    holder = registry.alias_holder(client, name, args.alias)
    decision = registry.decide(version, holder, args.alias)
    if not decision.promote:
        print(f"not promoted: {decision.reason}")
        return EXIT_REFUSED
    client.set_registered_model_alias(name, args.alias, version.version)
    print(f"promoted: {name} version {version.version} is now @{args.alias} ({decision.reason}); "
          f"load it with mlflow.pyfunc.load_model('models:/{name}@{args.alias}')")
    return 0


if __name__ == "__main__":
    main_entry(main)
