"""The checks of nsa/ops/tuning.py's values, and the lookups it needs: each dataclass's __post_init__ calls
its check here, so a bad value fails where it is built with one line `<Class.field> must be <what>, got
<value>`. Duck-typed (tuning.py imports this module, not the other way); no torch or triton import.
"""
from __future__ import annotations


def need(ok: bool, name: str, want: str, value) -> None:
    """The checks' one error: `name must be <want>, got <value>`."""
    if not ok:
        raise ValueError(f"{name} must be {want}, got {value!r}")


def _int(v, lo: int = 0) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= lo


def check_max_regs(name: str, value) -> None:
    """A register cap (ptxas .maxnreg) is None or an int in [24, 255]."""
    need(value is None or _int(value, 24) and value <= 255, name, "None or an int in [24, 255]", value)


def check_gluon_slots(name: str, value: int, what: str) -> None:
    """A Gluon kernel's ring slots: 0 (the Triton kernel instead) or >= 2 (one slot cannot prefetch)."""
    need(value == 0 or value >= 2, name, f"0 (the Triton kernel) or >= 2 ({what} ring slots of the Gluon kernel)",
         value)


def check_select(s) -> None:
    """SelectTuning s."""
    for name in ("gluon_walk_stages", "gluon_dq_walk_stages"):
        check_gluon_slots(f"select.{name}", getattr(s, name), "q / dO")
    for name in ("walk_loop_stages", "dq_walk_loop_stages"):
        v = getattr(s, name)
        need(v in (0, 2, 3, 4) and not isinstance(v, bool), f"select.{name}", "0 (off), 2, 3 or 4", v)
    check_max_regs("select.pair_max_regs", s.pair_max_regs)
    for name, ok, want in (
            ("dq_walk_loop_min_g", _int(s.dq_walk_loop_min_g, 1), "an int >= 1 (query heads per KV head)"),
            ("loop", s.loop in ("token", "block", "auto"), "token, block or auto"),
            ("pair_dtype", s.pair_dtype in ("fp32", "input", "fp16"), "fp32, input or fp16"),
            ("dq_pair_dtype", s.dq_pair_dtype in ("fp32", "input", None), "fp32, input or null (pair_dtype)"),
            ("chunk", s.chunk >= 1, ">= 1 (tokens per dK/dV program)"),
            ("chunk_min_items", _int(s.chunk_min_items), "an int >= 0 (0: off)"),
            ("pair_chunk", s.pair_chunk >= 0, ">= 0 (0: select.chunk)"),
            ("block_max_g", _int(s.block_max_g), "an int >= 0 (query heads per KV head)"),
            ("dq_block_max_g", _int(s.dq_block_max_g), "an int >= 0 (query heads per KV head)"),
            *((n, isinstance(getattr(s, n), bool), "true or false") for n in ("pack_heads", "prefetch",
                                                                                "ids_in_regs"))):
        need(ok, f"select.{name}", want, getattr(s, name))


def check_tile(t, max_m: int) -> None:
    """TileTuning t; max_m: the most tokens per tile (tuning.TILE_MAX_M)."""
    need(1 <= t.m <= max_m, "TileTuning.m", f"in 1..{max_m} (1: per-token kernels)", t.m)
    need(t.min_g >= 1, "TileTuning.min_g", ">= 1 (1: tiles at every G)", t.min_g)
    need(t.group in (0, 8, 16, 32, 64) and not t.group % t.m, "TileTuning.group",
         f"0 (consecutive tokens) or 8 / 16 / 32 / 64, a multiple of m={t.m}", t.group)
    for f in ("gluon_fwd_stages", "gluon_dq_stages", "gluon_dq_short_stages"):
        check_gluon_slots(f"TileTuning.{f}", getattr(t, f), "K/V")
    need(t.gluon_dq_short_t >= 0, "TileTuning.gluon_dq_short_t", ">= 0 (0: never)", t.gluon_dq_short_t)


def check_scores(s) -> None:
    """ScoreTuning s (its tiles check themselves)."""
    need(s.gluon_min_t is None or s.gluon_min_t >= 0, "ScoreTuning.gluon_min_t", ">= 0 or None", s.gluon_min_t)


def check_cmp_dense(c) -> None:
    """CmpDenseTuning c."""
    need(c.mode in ("auto", "off", "cudnn", "flash", "math"), "CmpDenseTuning.mode", "auto/off/cudnn/flash/math",
         c.mode)


FLASH_BRANCH_MODES = ("off", "auto", "fa4", "fa2", "reference")


def check_flash(f) -> None:
    """FlashBranchTuning f."""
    need(f.win_split_min_t is None or f.win_split_min_t >= 0, "FlashBranchTuning.win_split_min_t",
         ">= 0 or None", f.win_split_min_t)
    for b in ("win", "cmp"):
        need(getattr(f, b) in FLASH_BRANCH_MODES, f"FlashBranchTuning.{b}", f"one of {FLASH_BRANCH_MODES}",
             getattr(f, b))


def flash_branches(spec: str) -> dict | None:
    """nsa.flash_branches: "preset" -> None (the device preset's), "off" -> {}, or "+"-joined branches
    ("win", "cmp", "win+cmp") -> {branch: "auto"}; anything else: a ValueError naming the choices."""
    if spec == "preset":
        return None
    parts = [] if spec == "off" else spec.split("+")
    if not parts and spec != "off" or any(p not in ("win", "cmp") for p in parts) or len(set(parts)) < len(parts):
        raise ValueError(f"flash_branches={spec!r}: choose preset, off, win, cmp or win+cmp")
    return {p: "auto" for p in parts}


def family_of(capability: tuple[int, int] | None) -> str:
    """The architecture family of a CUDA compute capability (None: no CUDA device); tuning.FAMILY_PRESET and
    plan.ARCHS are keyed by it."""
    if capability is None:
        return "cpu"
    major = capability[0]
    return "sm100" if major >= 10 else "sm90" if major == 9 else "sm80" if major == 8 else "sm75"
