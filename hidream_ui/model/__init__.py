"""The model: `layout` (upstream folder names, LoRA geometry), `sources` (where parts come from,
verification), `geometry`, `loading`, `plans` / `sizes` / `planner` / `fp8` (memory plans, the parts'
sizes from their configs, predicted peaks, fp8 storage), `settings` (what the package reads from the
app's settings: a protocol, so it never imports the config) and `tiny/` (the offline checkpoint builder).

Where the weights come from, checking them before a load, and loading them for E1.1 / E1-Full.

The same functions load the real 17B checkpoints and the offline tiny checkpoint (built by
`hidream_ui.model.tiny` in the upstream folder layout): there is no separate "test" loading path.

Upstream layout (what users of the NPU port keep on disk under one folder)::

    BASE/Llama-3.1-8B-Instruct/   config.json, tokenizer files, model-*.safetensors + index
    BASE/HiDream-I1-Full/         model_index.json, scheduler/, vae/, text_encoder{,_2,_3}/,
                                  tokenizer{,_2,_3}/, transformer/ (sharded + index)
    BASE/HiDream-E1-1/transformer/        (E1.1: sharded + diffusion_pytorch_model.safetensors.index.json)
    BASE/HiDream-E1-Full/HiDream-E1-Full.safetensors   (E1-Full: LoRA keys + a few plain keys)

Weight sets per stage (see README "Refine stage weights"):
- E1.1, refiner "e1" (default): upstream's demo snapshots `transformer.state_dict()` as its
  "editing" set, but that dict aliases the parameters, so after loading E1.1 both of its sets
  hold the E1.1 weights. Both stages therefore run on E1.1: we load E1.1 once and copy nothing.
- E1.1, refiner "i1": the documented intent (refine on HiDream-I1-Full). The I1 tensors that
  differ are kept as a second set and swapped in at the refine switch (`WeightSwap`).
- E1-Full: a LoRA on the I1 transformer; the refine stage disables the adapters. Upstream's
  "refine" copy of the few non-LoRA keys aliases the loaded parameters too, so its refine stage
  keeps E1-Full's values for them: refiner "e1" reproduces that; "i1" restores I1's originals.
"""
