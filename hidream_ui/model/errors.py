"""The model layer's error, in a module of its own so that every model module (sources, fp8,
loading, tiny/) can raise it without importing another one."""

from __future__ import annotations


class ModelError(RuntimeError):
    """The configured model cannot be used; the message names what is missing or wrong."""
