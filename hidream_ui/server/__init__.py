"""Everything between the socket and a UI handler: the HTTP guard and login limits (`guard`), the
upload gate, served results, per-client storage and the cache janitor (`files`), the admission
lanes (`lanes`), the kiosk operator (`operator`) and the one place that touches Gradio's private
API (`gradio_internals`).

Importing this package is free; the modules import what they need themselves.
"""
