"""`train-tiny OUT [--steps N] [--seed S]`: trains the `trained` tiny profile on the synthetic world.

Data comes from the world on the fly (lab/world.py; training seeds only, below HELD_OUT_SEED_START). Two phases:

1. The VAE learns to reconstruct world images (pixel MSE, latents kept near unit size); its latent shift and
   scale are then measured so latents enter the transformer about N(0, 1), like the release's (`vae`).
2. The E1 transformer learns exactly the two calls the pipeline makes (pipeline/edit_pipeline.py; `loop`):
   - edit stage: input ``cat([x_t, source], width)`` (16 x 32 latent), instruction text; its output's left
     half is read. Condition dropout: the source replaced by zeros (the pipeline's unconditional branch is
     ``zeros`` + the instruction under CLIP CFG norm) and the text replaced by the negative prompt (the
     image-conditioned branch), so E1.1's three-way guidance has something to combine;
   - refine stage: input ``x_t`` alone (16 x 16), the target prompt (E1.1: the instruction itself) or the
     negative prompt, at the low noise levels the refine share of the schedule covers.
   Flow matching as the scheduler reads it (UniPC, flow_prediction, flow sigmas): ``x_t = (1 - s) x_0 + s e``
   at timestep ``1000 s``; the scheduler wants ``e - x_0`` and the pipeline negates the transformer's output,
   so the transformer is trained towards ``x_0 - e``. Noise levels are drawn through the schedule's shift 3
   (`schedule`).

The text encoders keep the random weights of the build (seed S): the transformer learns to read them. The
embeddings of every prompt the world has are computed once with the pipeline's own `encode_text`.

Deterministic for a seed on one machine (one thread by default; the RNGs are all seeded generators).

Modules: `settings` (TrainSettings, the recorded command's knobs), `schedule` (noise levels, learning rate),
`data` (the world's prompts, training seeds, the latent pool), `model` (the transformer's init, the copy heads,
the grounding head), `vae`, `loop` (the transformer's training steps), `decoder` (`--decoder-from`), `run`
(`train`: one whole run into an asset folder), `evaluate` (`--eval`, `--grid`, `--oracle`,
`--calibrate-magcache`) and `cli` (the command). Nothing is imported here: `python -m hidream_ui train-tiny`
runs `cli.main`.
"""
