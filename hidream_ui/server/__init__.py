"""Everything between the socket and a UI handler: the HTTP guard and login limits (`guard`), the
upload gate (`upload_gate`), served results (`served_results`), per-client storage
(`client_storage`, `storage_limits`) and the cache janitor (`janitor`), named together by `files`;
the admission lanes (`lanes`), the kiosk operator (`operator`), and the one seam to Gradio's private
API: `gradio_internals` (what the app imports), its registry of overrides (`gradio_seam`) and their
bodies (`gradio_queue`, `gradio_sessions`, `gradio_cache`).

Importing this package is free; the modules import what they need themselves.
"""
