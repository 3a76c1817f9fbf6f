"""hidream_ui: a device-aware browser demo for HiDream-E1.1 / HiDream-E1-Full image editing.

Nothing heavy is imported here: `import hidream_ui` must stay instant so that the CLI's
``--help`` and the app's cold start do not pay for torch, diffusers or gradio.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
