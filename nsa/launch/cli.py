"""Shared command line of the pipeline entry points: ``--config PROFILE.yaml`` plus ``section.key=value``
overrides; ``--help`` lists every config key with its default and type.

User errors (bad config, bad data path, bad checkpoint, unknown key) end the program with exit code 2 and
one clear ``error:`` line on stderr, never a traceback.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Callable, NoReturn, Optional, get_type_hints

from nsa.config import SECTIONS, ConfigError, RunConfig, resolve_config

# the checkout this package lives in (nsa/launch/cli.py -> repo root): profiles given relative to the
# repository resolve from any working directory
REPO_ROOT = Path(__file__).resolve().parents[2]
CONFIG_DIR = REPO_ROOT / "pipelines" / "configs"
EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


class UserError(ValueError):
    """A problem the user fixes by changing the command line, config or files (exit code 2)."""


def config_keys_help() -> str:
    """All keys, one line each: ``section.key  type  default``."""
    lines = ["config keys (override with section.key=value; NSA_* env vars map to some, see nsa/config/):"]
    for s, cls in SECTIONS.items():
        hints = get_type_hints(cls)
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore
            typ = getattr(hints[f.name], "__name__", str(hints[f.name]).replace("typing.", ""))
            lines.append(f"  {s + '.' + f.name:<34} {typ:<14} {default!r}")
    return "\n".join(lines)


def build_parser(prog: str, description: str, default_config: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=description, epilog=config_keys_help(),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=default_config,
                   help=f"YAML profile (default: {default_config}; profiles live in pipelines/configs/)")
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    p.add_argument("overrides", nargs="*", metavar="section.key=value",
                   help="config overrides, highest precedence (e.g. train.steps=100 runtime.num_workers=1)")
    return p


def resolve_profile(path: str) -> str:
    """A profile path as given, or relative to the repository (so any working directory works)."""
    p = Path(path)
    if p.is_file() or p.is_absolute():
        return str(p)
    for base in (REPO_ROOT, CONFIG_DIR):
        if (base / p).is_file():
            return str(base / p)
    return str(p)


def load_config(args: argparse.Namespace) -> tuple[RunConfig, dict[str, str]]:
    try:
        return resolve_config(resolve_profile(args.config), list(args.overrides))
    except ConfigError as e:
        raise UserError(f"config: {e}") from None


def die(msg: str, code: int = EXIT_USAGE) -> NoReturn:
    print(f"error: {msg}", file=sys.stderr, flush=True)
    raise SystemExit(code)


def guarded(main: Callable[[], int]) -> Callable[[], int]:
    """Run ``main`` turning user errors into one stderr line and exit code 2."""
    from nsa.train.checkpoint import CheckpointError

    def wrapper() -> int:
        try:
            return main()
        except (UserError, ConfigError, CheckpointError, FileNotFoundError, FileExistsError) as e:
            die(str(e))
        except OSError as e:   # full disk, read-only storage, ...: the cause in one line, not a traceback
            from nsa.train.rundir import failure_line
            die(failure_line(e), EXIT_FAILED)
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            return 130
        return EXIT_OK  # unreachable; keeps type checkers quiet

    return wrapper


def print_header(title: str, cfg: RunConfig, sources: dict[str, str], profile: Optional[str]) -> None:
    from nsa.config import format_config
    print(f"== {title}: resolved config (profile {profile}) ==")
    print(format_config(cfg, sources), flush=True)


def main_entry(fn: Callable[[], int]) -> None:
    sys.exit(guarded(fn)())

