"""``python -m nsa.telemetry check <run_dir> ...`` | ``python -m nsa.telemetry plot <csv> <png>``."""
from __future__ import annotations

import sys
from typing import Sequence

USAGE = ("usage: python -m nsa.telemetry check <run_dir> [options]   (see: check --help)\n"
         "       python -m nsa.telemetry plot <training.csv> <out.png>")


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if args else 2
    command, rest = args[0], args[1:]
    if command == "check":
        from .check import main as check_main
        return check_main(rest)
    if command == "plot" and len(rest) == 2:
        from .loggers import plot_training
        print(plot_training(rest[0], rest[1]))
        return 0
    print(USAGE, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
