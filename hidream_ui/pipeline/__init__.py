"""The editing pipeline (`edit_pipeline`) and its attention strategies (`attention/`)."""
