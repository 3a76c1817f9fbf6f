"""Command-line entry points: `app` (the Gradio app), `edit`, `doctor`, `plan`."""
