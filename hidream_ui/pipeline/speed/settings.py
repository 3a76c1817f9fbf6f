"""The speed settings as plain values: parsing and checks, no torch (config validation imports this).

One home for the grammar of `--cache` / the Speed setting and for the rule tying `--compile blocks`
to the sync-free MoE.
"""

from __future__ import annotations

from dataclasses import dataclass

# The UI's "Speed" setting (and `--cache` accepts these names too).
# `fast` / `faster`: what the rules (pipeline/speed/preset_rules.py) pick from the shipped weights' recorded
# `bench quality` run (assets/tiny_trained/quality.json); tests/test_speed_presets.py re-applies them to the
# record and fails when these are not the rules' choice. Their figures: docs/speed.md "Which cache the presets are".
SPEED_PRESETS = {"exact": "none", "fast": "magcache:0.24@20", "faster": "magcache:0.24@10"}
INTERVAL_RANGE = (1, 100)
# --moe and --compile: their one home (config's flags and help read these).
MOE_CHOICES = ("auto", "diffusers", "sync-free")  # auto: sync-free with --compile blocks, else diffusers
COMPILE_CHOICES = ("none", "blocks")
THRESHOLD_RANGE = (0.0, 10.0)  # T must be > 0 (0 would never skip: use none)
# `CACHE@N`: the cache with at most N denoising steps (fewer steps are a speed axis too: bench quality
# --steps-grid). An edit asking for more runs N; one asking for fewer keeps its own count. The range is the
# Steps field's (edits.STEPS_RANGE is this one).
MAX_STEPS_RANGE = (1, 200)
# The step caches by kind: which number each takes ("interval": an integer K/N, "threshold": a float T).
# `interval`, `first-block`: our own hooks (pipeline/speed/cache.py); `fbcache`, `taylorseer`, `magcache`:
# diffusers' hooks on HiDream's blocks (pipeline/speed/library.py); `dbcache`: cache-dit's DBCache with
# its TaylorSeer calibrator (pipeline/speed/cachedit.py, the optional extra `cache-dit`).
CACHE_KINDS = {
    "interval": "interval",
    "first-block": "threshold",
    "fbcache": "threshold",
    "taylorseer": "interval",
    "magcache": "threshold",
    "dbcache": "threshold",
}
# The step caches the benchmarks measure by default (`bench quality` on the trained model, `bench speed` on the
# deep one; `--caches` replaces the list): ours, diffusers' hooks on HiDream's blocks, cache-dit's. One list, so
# the quality and the speed of each configuration come from the same names.
MEASURED_CACHES = (
    "interval:2",
    "interval:3",
    "interval:4",
    "first-block:0.05",
    "first-block:0.1",
    "first-block:0.2",
    "fbcache:0.05",
    "fbcache:0.1",
    "fbcache:0.2",
    "taylorseer:2",
    "taylorseer:3",
    "taylorseer:4",
    "taylorseer:5",
    "magcache:0.06",
    "magcache:0.12",
    "magcache:0.24",
    "dbcache:0.05",
    "dbcache:0.1",
    "dbcache:0.2",
)
CACHE_GRAMMAR = (
    f"none, interval:K or taylorseer:N ({INTERVAL_RANGE[0]}..{INTERVAL_RANGE[1]}), "
    f"first-block:T, fbcache:T, magcache:T or dbcache:T (0 < T <= {THRESHOLD_RANGE[1]:g}), "
    f"any of them with @S for at most S steps (e.g. taylorseer:4@14), "
    f"or {', '.join(SPEED_PRESETS)}"
)


@dataclass(frozen=True)
class CacheSpec:
    """A parsed step-cache mode; `str()` is its canonical spelling (what metadata records)."""

    kind: str = "none"
    interval: int = 1
    threshold: float = 0.0
    max_steps: int | None = None  # `@N`: at most N denoising steps (None: the edit's own count)

    def __str__(self) -> str:
        number = CACHE_KINDS.get(self.kind)
        if number == "interval":
            text = f"{self.kind}:{self.interval}"
        elif number == "threshold":
            text = f"{self.kind}:{self.threshold:g}"
        else:
            text = "none"
        return text if self.max_steps is None else f"{text}@{self.max_steps}"

    @property
    def active(self) -> bool:
        """A step cache is installed (the step cap alone installs nothing)."""
        return self.kind != "none"

    @property
    def cache_only(self) -> CacheSpec:
        """This spec without its step cap: what the transformer's hooks are."""
        return CacheSpec(self.kind, self.interval, self.threshold)

    def steps_for(self, requested: int) -> int:
        """The denoising steps an edit asking for `requested` runs under this spec."""
        return requested if self.max_steps is None else min(requested, self.max_steps)


def parse_cache(text: object, name: str = "cache") -> CacheSpec:
    """`none` | `KIND:NUMBER` (CACHE_KINDS, CACHE_GRAMMAR) | a Speed preset (`exact`, `fast`, `faster`).

    Raises ValueError naming `name` and the value."""
    raw = str(text).strip().lower()
    raw = SPEED_PRESETS.get(raw, raw)
    raw, at, cap = raw.partition("@")
    max_steps = None
    if at:
        try:
            max_steps = int(cap)
        except ValueError:
            max_steps = 0
        if not MAX_STEPS_RANGE[0] <= max_steps <= MAX_STEPS_RANGE[1]:
            raise ValueError(
                f"{name}={text!r} is not valid: @S takes a step count from {MAX_STEPS_RANGE[0]} to "
                f"{MAX_STEPS_RANGE[1]}; use {CACHE_GRAMMAR}"
            )
    if raw == "none":
        return CacheSpec(max_steps=max_steps)
    kind, sep, value = raw.partition(":")
    number = CACHE_KINDS.get(kind) if sep else None
    try:
        if number == "interval":
            k = int(value)
            if INTERVAL_RANGE[0] <= k <= INTERVAL_RANGE[1]:
                return CacheSpec(kind, interval=k, max_steps=max_steps)
        elif number == "threshold":
            t = float(value)
            if THRESHOLD_RANGE[0] < t <= THRESHOLD_RANGE[1]:  # also refuses nan and inf
                return CacheSpec(kind, threshold=t, max_steps=max_steps)
    except ValueError:
        pass
    raise ValueError(f"{name}={text!r} is not valid: use {CACHE_GRAMMAR}")


CACHE_DIT_HINT = "pip install 'hidream_ui[cache-dit]' (or -r requirements-cache-dit.txt)"


def cache_unavailable(spec: CacheSpec) -> str | None:
    """Why `spec` cannot run in this environment (None when it can). Looks the optional package up
    without importing it (config and request validation call this)."""
    if spec.kind == "dbcache":
        import importlib.util

        if importlib.util.find_spec("cache_dit") is None:
            return f"cache={spec} needs the optional package cache-dit, which is not installed: {CACHE_DIT_HINT}"
    return None


def effective_moe(moe: str, compile_mode: str) -> str:
    """`--moe auto` resolved: graph capture needs a MoE without host syncs."""
    if moe == "auto":
        return "sync-free" if compile_mode == "blocks" else "diffusers"
    return moe


class SpeedSettingError(ValueError):
    """A --moe / --compile / --cache value (or pair) that cannot be used; the message names it
    (config.validate turns it into a ConfigError)."""


def check_speed(moe: str, compile_mode: str, cache: str, transformer_offloaded: bool = False) -> None:
    """Checks --moe / --compile / --cache (`transformer_offloaded`: the --memory plan streams the
    transformer's blocks); raises SpeedSettingError naming the value."""
    if moe not in MOE_CHOICES:
        raise SpeedSettingError(f"moe={moe!r} is not one of: {', '.join(MOE_CHOICES)}")
    if compile_mode not in COMPILE_CHOICES:
        raise SpeedSettingError(f"compile={compile_mode!r} is not one of: {', '.join(COMPILE_CHOICES)}")
    if compile_mode == "blocks" and moe == "diffusers":
        raise SpeedSettingError(
            "compile='blocks' needs moe 'sync-free' (or 'auto'): diffusers' MoE reads expert "
            "counts on the host in every block, which breaks the graph at every block"
        )
    try:
        spec = parse_cache(cache)
    except ValueError as exc:
        raise SpeedSettingError(str(exc)) from None
    reason = cache_unavailable(spec)
    if reason:
        raise SpeedSettingError(reason)
    # cache-dit replaces the forwards that carry these hooks (pipeline/speed/cachedit.py); an `auto`
    # plan that ends up offloading is refused at the first edit instead, with the same reason.
    if spec.kind == "dbcache" and compile_mode == "blocks":
        raise SpeedSettingError(
            f"cache={spec} cannot run with compile='blocks': cache-dit replaces the "
            "transformer's forward, which would drop the compile guard hook"
        )
    if spec.kind == "dbcache" and transformer_offloaded:
        raise SpeedSettingError(
            f"cache={spec} cannot run with a memory plan that offloads the transformer: "
            "cache-dit replaces the blocks' forwards, which would drop the offloading hooks"
        )
