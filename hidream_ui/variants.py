"""The model variants the app runs: the one list, below both the config (which validates --variant
against it) and the edit schema (whose per-variant defaults are keyed by it), so neither imports the
other for it.
"""

from __future__ import annotations

# E1.1 (plain instructions) and E1-Full (a LoRA on HiDream-I1-Full, "Editing Instruction: ... Target
# Image Description: ..." prompts). The first is the default.
VARIANTS = ("e1.1", "e1-full")
DEFAULT_VARIANT = VARIANTS[0]
