"""The lab: research code that made the trained offline model, kept out of the runtime.

- `world`: the synthetic world's held-out cases and success metric (the scenes are the runtime's,
  hidream_ui/model/tiny/world.py);
- `train/`: `python -m hidream_ui train-tiny` (the VAE, the transformer, the decoder fine-tune, evaluation);
- `scoring`: the pipeline trained weights are scored through and the summary of verdicts;
- `probe`: `train-tiny --one-call`, what one transformer call makes of the truth;
- `words`: the designed text-encoder weights (`train-tiny --word-encoders`).

The runtime (every module under hidream_ui/ but lab/ and bench/) never imports this package
(tests/test_lab_boundary.py); the `train-tiny` command is only a string in the command table until it runs.
Write-ups of the experiments run with it: docs/lab-notebook.md.
"""
