"""Speed modes (README "Speed modes"): `moe` (sync-free MoE), `cache` (step caching), `compile`
(regional compilation of the repeated blocks), `syncs` (host-sync counting), `settings` (the
parsed flags). Nothing here runs at import; each file imports torch/diffusers itself.
"""
