"""The editing pipeline (`edit_pipeline`), its guidance, masks, previews, attention strategies
(`attention/`) and speed modes (`speed/`). Plain arguments in, typed outputs out: like a diffusers
pipeline it imports nothing from the app (its defaults and text rules are `defaults` and `prompts`;
tests/test_import_graph.py checks it)."""
