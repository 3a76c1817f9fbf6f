"""The offline tiny checkpoint: `build` (make-tiny, the cache), `profiles`, `parts` (one writer per
upstream folder), `weights`, `tokenizers`, `files`; for the trained profile `trained` (the shipped weights'
format), `quality_record` (their `bench quality` record) and `world` (the scenes it knows, for the app's
examples). How those weights were trained (`train-tiny`, probes, scoring) is the lab's: hidream_ui/lab/.

Offline builder of random-weight HiDream checkpoints in the upstream folder layout.

The real weights (HiDream-I1-Full, HiDream-E1-1, HiDream-E1-Full and Llama-3.1-8B-Instruct, ~50 GB) can
never be downloaded on a test machine. This module writes the same folders, file names, config keys, tokenizer
files and safetensors key names with tiny random weights, so that the project's loader (plain diffusers /
transformers ``from_pretrained`` calls) takes exactly the code path it takes for the 17B release:

```
<out_dir>/
  hidream_ui_tiny.json                    marker: profile, seed, format version
  Llama-3.1-8B-Instruct/                  LlamaForCausalLM + byte-level BPE tokenizer.json (Llama-3 specials)
  HiDream-I1-Full/                        model_index.json, scheduler/, text_encoder{,_2,_3}/,
                                          tokenizer{,_2,_3}/, transformer/ (sharded), vae/
  HiDream-E1-1/transformer/               same architecture as I1, different weights (sharded)
  HiDream-E1-Full/HiDream-E1-Full.safetensors   peft-wrapped LoRA keys + a few replaced plain keys
```

Everything is deterministic: the same profile and seed give byte-identical trees. Each tensor is drawn from its
own generator seeded by ``sha256(seed, stream, tensor name)``, so the order of generation does not matter and
the large "bench" profile can be written shard by shard without holding a whole model in memory. Tokenizers are
constructed from fixed vocabularies and merges (the ``tokenizers`` trainers are not deterministic).

Nothing heavy is imported at module import time: torch, diffusers, transformers, tokenizers, safetensors and
peft are imported inside the functions that need them.
"""
