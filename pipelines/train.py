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

from _cli import build_parser, load_config, main_entry, print_header
from builder import launch

DEFAULT_PROFILE = "pipelines/configs/tiny_cpu.yaml"


def main() -> int:
    args = build_parser("train.py", __doc__.split("\n")[1], DEFAULT_PROFILE).parse_args()
    cfg, sources = load_config(args)
    print_header("train", cfg, sources, args.config)
    if args.print_config:
        return 0
    return launch(cfg, sources, prefix="train").exit_code


if __name__ == "__main__":
    main_entry(main)
