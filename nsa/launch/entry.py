"""The training entry point: ``pipelines/train.py`` and ``pipelines/prod_50k.py`` are this one main with
different default profiles (tiny CPU run vs the production run)."""
from __future__ import annotations

from nsa.launch.builder import launch
from nsa.launch.cli import build_parser, load_config, main_entry, print_header


def train_main(name: str, doc: str, default_profile: str, prefix: str) -> int:
    """Parse ``--config`` + overrides, print the resolved config, then validate and launch the run.
    ``name`` is the program (``train``, ``prod_50k``), ``doc`` its module docstring (first line = description),
    ``prefix`` starts fresh run names (``<prefix>-<time>-<hex>``)."""
    args = build_parser(f"{name}.py", doc.split("\n")[0], default_profile).parse_args()
    cfg, sources = load_config(args)
    print_header(name, cfg, sources, args.config)
    if args.print_config:
        return 0
    return launch(cfg, sources, prefix=prefix).exit_code


def run_train(name: str, doc: str, default_profile: str, prefix: str) -> None:
    """``train_main`` under ``main_entry``: user errors -> one stderr line and exit code 2."""
    main_entry(lambda: train_main(name, doc, default_profile, prefix))
