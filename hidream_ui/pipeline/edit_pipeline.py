"""HiDreamEditPipeline: instruction-based editing with HiDream-E1.1 / E1-Full, written from the
published algorithm (see README "The editing algorithm").

It reuses the text-encoding helpers of diffusers' HiDream text-to-image pipeline and adds:
- the editing step (noise and source latents side by side along the width, three-way guidance),
- the refine stage (no image conditioning, target-prompt guidance, optional weight switch),
- exact padding collapse: the transformer pads non-square inputs to `max_seq` tokens and only
  zeroes the padded keys, so every padded token is identical through every block; we send one
  padded token whose attention logit carries `log P` instead of P copies (see attention.py),
- per-text embeddings so the engine can cache them (`prompt_embeds_fn`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import PIL.Image
import torch
from diffusers.pipelines.hidream_image.pipeline_hidream_image import (
    HiDreamImagePipeline,
    calculate_shift,
    retrieve_timesteps,
)
from diffusers.pipelines.hidream_image.pipeline_output import HiDreamImagePipelineOutput
from diffusers.utils.torch_utils import randn_tensor

from hidream_ui.pipeline import defaults
from hidream_ui.pipeline.guidance import combine_edit_guidance, combine_refine_guidance, refine_start_step
from hidream_ui.pipeline.prompts import PROMPT_TOKENS, target_prompt
from hidream_ui.pipeline.speed.cache import reset_step_cache, step_cache_stats


def collapsed_tokens(hidden: torch.Tensor, patch_size: int, max_seq: int):
    """Patchifies a non-square latent (B, C, H, W) into its real tokens plus ONE padded token standing
    for all `max_seq - n` padded ones (mask value -P; `pipeline.attention.processor.key_terms` reads
    it as multiplicity P). Returns (tokens, mask, sizes, ids) as the transformer takes them.

    The one home of the collapse encoding: the pipeline and the benchmarks build their inputs here.
    """
    batch, channels, height, width = hidden.shape
    p = patch_size
    ph, pw = height // p, width // p
    n = ph * pw
    pad = max_seq - n
    if pad < 0:
        raise ValueError(
            f"a {ph}x{pw}-patch edit input needs {n} tokens, more than this model's max_seq {max_seq}: "
            "use a smaller working resolution"
        )
    # Same feature order as the transformer's own patchify: (row-in-patch, col-in-patch, channel).
    tokens = hidden.reshape(batch, channels, ph, p, pw, p).permute(0, 2, 4, 3, 5, 1).reshape(batch, n, -1)
    ids = torch.zeros(n, 3, device=hidden.device)
    ids[:, 1] = torch.arange(ph, device=hidden.device).repeat_interleave(pw)
    ids[:, 2] = torch.arange(pw, device=hidden.device).repeat(ph)
    # float32 so the multiplicity P is exact whatever the model dtype.
    mask = torch.ones(batch, n + (1 if pad else 0), dtype=torch.float32, device=hidden.device)
    if pad:
        tokens = torch.cat([tokens, tokens.new_zeros(batch, 1, tokens.shape[-1])], dim=1)
        ids = torch.cat([ids, ids.new_zeros(1, 3)], dim=0)
        mask[:, n] = -float(pad)
    ids = ids.unsqueeze(0).expand(batch, -1, -1)
    sizes = torch.tensor([[ph, pw]] * batch, dtype=torch.int64, device=hidden.device)
    return tokens, mask, sizes, ids


@dataclass
class PromptEmbeds:
    """The three text conditionings of one or more prompts, stacked along the batch axis."""

    t5: torch.Tensor  # (B, L, D_t5)
    llama: torch.Tensor  # (layers, B, L, D_llama)
    pooled: torch.Tensor  # (B, D_clip_l + D_clip_g)

    @staticmethod
    def cat(parts: Sequence["PromptEmbeds"]) -> "PromptEmbeds":
        return PromptEmbeds(
            t5=torch.cat([p.t5 for p in parts], dim=0),
            llama=torch.cat([p.llama for p in parts], dim=1),
            pooled=torch.cat([p.pooled for p in parts], dim=0),
        )

    def to(self, device, dtype) -> "PromptEmbeds":
        return PromptEmbeds(self.t5.to(device, dtype), self.llama.to(device, dtype), self.pooled.to(device, dtype))


class EditInterrupted(RuntimeError):
    """The edit was cancelled between two steps."""


class HiDreamEditPipeline(HiDreamImagePipeline):
    """Edits images with an instruction; see the module docstring for the algorithm."""

    # Set by hidream_ui.model.loading after loading: where the transformer computes, and where text encoders live.
    compute_device: str | None = None
    text_encoder_mode: str = "device"
    # The last call's step-cache counters (None without a step cache; see pipeline/speed/cache.py).
    step_cache_stats = None

    # ------------------------------------------------------------------ text
    def _get_llama3_prompt_embeds(self, prompt=None, max_sequence_length=PROMPT_TOKENS, device=None, dtype=None):
        # Same as diffusers' version without `output_attentions=True`: attentions are never used, and
        # asking for them forces transformers' eager attention (slow, and O(L^2) memory per layer).
        prompt = [prompt] if isinstance(prompt, str) else prompt
        inputs = self.tokenizer_4(
            prompt,
            padding="max_length",
            max_length=min(max_sequence_length, self.tokenizer_4.model_max_length),
            truncation=True,
            add_special_tokens=True,
            return_tensors="pt",
        )
        outputs = self.text_encoder_4(
            inputs.input_ids.to(device), attention_mask=inputs.attention_mask.to(device), output_hidden_states=True
        )
        return torch.stack(outputs.hidden_states[1:], dim=0)

    @torch.no_grad()
    def encode_text(self, text: str, max_sequence_length: int = PROMPT_TOKENS) -> PromptEmbeds:
        """Runs the four text encoders on one text; returns embeddings on the compute device.

        Where the encoders run is the memory plan's business (model/plans.py): on the host ("cpu"),
        resident, or streamed to the compute device by diffusers' offloading hooks while they run
        ("offload": the hooks move each group in and out; their inputs go to the compute device).
        """
        device = torch.device(self.compute_device or self._execution_device)
        dtype = self.transformer.dtype
        encoders = [self.text_encoder, self.text_encoder_2, self.text_encoder_3, self.text_encoder_4]
        inputs = [
            torch.device("cpu")
            if self.text_encoder_mode == "cpu"
            else device
            if self.text_encoder_mode == "offload"
            else encoder.device
            for encoder in encoders
        ]
        pooled = torch.cat(
            [
                self._get_clip_prompt_embeds(
                    self.tokenizer, self.text_encoder, [text], max_sequence_length, inputs[0], None
                ).to(device, dtype),
                self._get_clip_prompt_embeds(
                    self.tokenizer_2, self.text_encoder_2, [text], max_sequence_length, inputs[1], None
                ).to(device, dtype),
            ],
            dim=-1,
        )
        t5 = self._get_t5_prompt_embeds([text], max_sequence_length, inputs[2], None)
        llama = self._get_llama3_prompt_embeds([text], max_sequence_length, inputs[3], None)
        return PromptEmbeds(t5=t5.to(device, dtype), llama=llama.to(device, dtype), pooled=pooled)

    # ------------------------------------------------------------------ transformer
    def _collapsed_tokens(self, hidden: torch.Tensor):
        return collapsed_tokens(hidden, self.transformer.config.patch_size, self.transformer.max_seq)

    def predict(
        self, hidden: torch.Tensor, timestep: torch.Tensor, text: PromptEmbeds, collapse_padding: bool = True
    ) -> torch.Tensor:
        """One transformer call; returns the negated prediction (HiDream predicts the opposite sign)."""
        kwargs = dict(
            timesteps=timestep,
            encoder_hidden_states_t5=text.t5,
            encoder_hidden_states_llama3=text.llama,
            pooled_embeds=text.pooled,
            return_dict=False,
        )
        if collapse_padding and hidden.shape[-2] != hidden.shape[-1]:
            tokens, mask, _, ids = self._collapsed_tokens(hidden)
            # Sizes as host ints (the same values as the tensor): unpatchify slices with them, and a
            # device tensor there costs one device-to-host sync per image per call.
            p = self.transformer.config.patch_size
            sizes = [(hidden.shape[-2] // p, hidden.shape[-1] // p)] * hidden.shape[0]
            out = self.transformer(
                hidden_states=tokens, hidden_states_masks=mask, img_sizes=sizes, img_ids=ids, **kwargs
            )[0]
        else:
            out = self.transformer(hidden_states=hidden, **kwargs)[0]
        return -out

    # ------------------------------------------------------------------ call
    @property
    def interrupt(self):
        return getattr(self, "_interrupt", False)

    @torch.no_grad()
    def __call__(
        self,
        image: PIL.Image.Image | Sequence[PIL.Image.Image],
        prompt: str | Sequence[str],
        negative_prompt: str | Sequence[str] = defaults.NEGATIVE_PROMPT,
        guidance_scale: float = defaults.GUIDANCE_SCALE,
        image_guidance_scale: float = defaults.IMAGE_GUIDANCE_SCALE,
        num_inference_steps: int = defaults.NUM_INFERENCE_STEPS,
        refine_strength: float = defaults.REFINE_STRENGTH,
        clip_cfg_norm: bool = defaults.CLIP_CFG_NORM,
        generator: torch.Generator | list[torch.Generator] | None = None,
        num_images_per_prompt: int = 1,
        output_type: str = "pil",
        collapse_padding: bool = defaults.COLLAPSE_PADDING,
        max_sequence_length: int = PROMPT_TOKENS,
        mask: PIL.Image.Image | Sequence[PIL.Image.Image | None] | None = None,
        prompt_embeds_fn: Callable[[str], PromptEmbeds] | None = None,
        stage_fn: Callable[[str], None] | None = None,
        callback_on_step_end: Callable | None = None,
        callback_on_step_end_tensor_inputs: Sequence[str] = ("latents",),
        return_dict: bool = True,
    ):
        """Edits `image` (one or several images of the same working size, one prompt each).

        `prompt_embeds_fn(text)` supplies embeddings (the engine's cache); `stage_fn(stage)` is
        called with "edit" before the first step and "refine" at the switch, to put the transformer
        in that stage's weights; it is called with "edit" again at the end.

        `mask` (one per image, at the working size, white = may change; None: no region) keeps the
        source outside it at every step (pipeline/masks.py; the pixel composite is the caller's, at
        the output size). `callback_on_step_end` may ask for "latents", "noise" and "x0" (the clean
        image the step predicts: what a live preview shows).
        """
        images = [image] if isinstance(image, PIL.Image.Image) else list(image)
        prompts = [prompt] * len(images) if isinstance(prompt, str) else list(prompt)
        negatives = [negative_prompt] * len(images) if isinstance(negative_prompt, str) else list(negative_prompt)
        if not images or len(prompts) != len(images) or len(negatives) != len(images):
            raise ValueError(
                f"got {len(images)} images, {len(prompts)} prompts and {len(negatives)} negative prompts:"
                " give one prompt (and negative prompt) per image"
            )
        width, height = images[0].size
        if any(im.size != (width, height) for im in images):
            sizes = sorted({im.size for im in images})
            raise ValueError(f"all images of one call must share a working size; got {sizes}")
        unit = self.vae_scale_factor * 2
        if width % unit or height % unit:
            raise ValueError(f"working size {width}x{height} must be a multiple of {unit} on both sides")
        if num_inference_steps < 1:
            raise ValueError(f"num_inference_steps={num_inference_steps} must be at least 1")
        masks = [mask] * len(images) if mask is None or isinstance(mask, PIL.Image.Image) else list(mask)
        if len(masks) != len(images) or any(m is not None and m.size != (width, height) for m in masks):
            raise ValueError(
                f"give one mask (or None) per image at the working size {width}x{height}; got "
                f"{[None if m is None else m.size for m in masks]}"
            )
        self._interrupt = False
        device = torch.device(self.compute_device or self._execution_device)
        dtype = self.transformer.dtype
        encode = prompt_embeds_fn or (lambda text: self.encode_text(text, max_sequence_length))
        stage = stage_fn or (lambda name: None)
        repeat = num_images_per_prompt
        prompts = [p for p in prompts for _ in range(repeat)]
        negatives = [n for n in negatives for _ in range(repeat)]
        count = len(prompts)
        do_cfg = guidance_scale > 1

        # 1. Text: one embedding per unique text (the cache makes repeats free).
        pos = PromptEmbeds.cat([encode(p) for p in prompts])
        target = PromptEmbeds.cat([encode(target_prompt(p)) for p in prompts])
        neg = PromptEmbeds.cat([encode(n) for n in negatives]) if do_cfg else None

        # 2. Source latents: the distribution's mode, shifted and scaled like HiDream's training latents.
        pixels = self.image_processor.preprocess(images, height=height, width=width)
        # The VAE may live on another device than the transformer (--placement vae=DEV).
        pixels = pixels.to(device=self.vae.device, dtype=self.vae.dtype)
        source = self.vae.encode(pixels).latent_dist.mode()
        source = (source - self.vae.config.shift_factor) * self.vae.config.scaling_factor
        source = source.to(device=device, dtype=dtype).repeat_interleave(repeat, dim=0)

        # 3. Starting noise (sampled on the generator's device: CPU by default, see device/runtime.py).
        shape = (count, self.transformer.config.in_channels, source.shape[-2], source.shape[-1])
        latents = randn_tensor(shape, generator=generator, device=device, dtype=dtype)
        region = None
        if any(m is not None for m in masks):
            from hidream_ui.pipeline.masks import keep_outside, latent_mask

            region = latent_mask([m for m in masks for _ in range(repeat)], tuple(latents.shape[-2:]), device, dtype)
            start_noise = latents  # the same noise at every step (and for the same seed, the same edit)

        # 4. Conditioning batches.
        if do_cfg:
            edit_image = torch.cat([torch.zeros_like(source), source, source])
            edit_text = PromptEmbeds.cat([pos if clip_cfg_norm else neg, neg, pos])
            refine_text = PromptEmbeds.cat([neg, target])
        else:
            edit_image, edit_text, refine_text = source, pos, target

        # 5. Timesteps: the checkpoint's flow-matching schedule with HiDream's resolution shift.
        mu = calculate_shift(self.transformer.max_seq)
        timesteps, num_inference_steps = retrieve_timesteps(self.scheduler, num_inference_steps, device, mu=mu)
        self._num_timesteps = len(timesteps)
        switch = refine_start_step(num_inference_steps, refine_strength)
        width_latent = latents.shape[-1]

        stage("edit")
        # Step cache (if one is installed): nothing cached may cross edits or the refine switch; `calls`
        # is each stage's number of transformer calls (MagCache spreads its per-step ratios over them).
        reset_step_cache(
            self.transformer, stats=True, calls=switch or num_inference_steps, stage="edit" if switch else "refine"
        )
        try:
            for i, t in enumerate(timesteps):
                if self.interrupt:
                    raise EditInterrupted(f"cancelled after {i} of {num_inference_steps} steps")
                if i == switch:
                    stage("refine")
                    reset_step_cache(self.transformer, calls=num_inference_steps - switch, stage="refine")
                if i < switch:
                    copies = 3 if do_cfg else 1
                    hidden = torch.cat([torch.cat([latents] * copies), edit_image], dim=-1)
                    pred = self.predict(hidden, t.expand(hidden.shape[0]), edit_text, collapse_padding)
                    pred = pred[..., :width_latent]
                    if do_cfg:
                        u, ic, fc = pred.chunk(3)
                        noise = combine_edit_guidance(u, ic, fc, guidance_scale, image_guidance_scale, clip_cfg_norm)
                    else:
                        noise = pred
                else:
                    hidden = torch.cat([latents] * 2) if do_cfg else latents
                    pred = self.predict(hidden, t.expand(hidden.shape[0]), refine_text, collapse_padding)
                    if do_cfg:
                        u, c = pred.chunk(2)
                        noise = combine_refine_guidance(u, c, guidance_scale)
                    else:
                        noise = pred
                latents = self.scheduler.step(noise, t, latents, return_dict=False)[0]
                if region is not None:
                    latents = keep_outside(latents, region, source, start_noise, self.scheduler.sigmas[i + 1])
                if callback_on_step_end is not None:
                    wanted = tuple(callback_on_step_end_tensor_inputs)
                    names = {"latents": latents, "noise": noise}
                    if "x0" in wanted:  # flow matching: x_t = x0 + sigma * v, for the sigma after this step
                        names["x0"] = latents - self.scheduler.sigmas[i + 1].to(latents.device, latents.dtype) * noise
                    outputs = callback_on_step_end(self, i, t, {k: names[k] for k in wanted if k in names})
                    latents = (outputs or {}).get("latents", latents)
        finally:
            stage("edit")
            self.step_cache_stats = step_cache_stats(self.transformer)
            reset_step_cache(self.transformer)  # frees the cached activations

        if output_type == "latent":
            result = latents
        else:
            latents = latents.to(self.vae.device)
            decoded = self.vae.decode(
                (latents / self.vae.config.scaling_factor) + self.vae.config.shift_factor, return_dict=False
            )[0]
            result = self.image_processor.postprocess(decoded, output_type=output_type)
        if not return_dict:
            return (result,)
        return HiDreamImagePipelineOutput(images=result)
