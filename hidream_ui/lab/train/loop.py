"""The transformer's training steps: flow matching on the edit and refine stages the pipeline calls, condition
dropout, content drift and self drift, the grounding loss, and the EMA the run writes."""

from __future__ import annotations

import copy
import time

import numpy as np

from hidream_ui.lab.train.data import CasePool
from hidream_ui.lab.train.model import GroundingHead, make_transformer, training_mode
from hidream_ui.lab.train.schedule import REFINE_MAX_SIGMA, edit_sigmas, set_lr, shifted_sigma, unshift


def train_transformer(spec, vae, shift, scale, embeds, n_prompts, settings, seeds, prompts, log, save, init=None):
    import torch

    def encode(pixels):
        with torch.no_grad():
            return (vae.encode(pixels).latent_dist.mode() - shift) * scale

    model = make_transformer(spec, settings.seed + 2)
    if init is not None:
        model.load_state_dict(init)
    training_mode(model)
    generator = torch.Generator().manual_seed(settings.seed + 3)
    negative = n_prompts  # index of the negative prompt in `embeds`
    width = spec.max_resolution[1]  # latent width of one image
    prompt_ids = {p: i for i, p in enumerate(prompts)}
    grounding = ground_pool = None
    if settings.ground_steps or settings.ground_weight or settings.ground_flow:
        grounding = GroundingHead(model, spec, settings.ground_block, torch)
        t0 = time.perf_counter()
        ground_pool = CasePool(settings.pool, encode, seeds, prompt_ids, torch, tokens=grounding.cols)
        log(f"train-tiny: {settings.pool} grounding cases encoded in {time.perf_counter() - t0:.0f} s")
    parameters = [*model.parameters(), *(grounding.head.parameters() if grounding else ())]

    def forward(hidden, sigma, prompt_ids):
        return model(
            hidden_states=hidden,
            timesteps=sigma * 1000,
            encoder_hidden_states_t5=embeds.t5[prompt_ids],
            encoder_hidden_states_llama3=embeds.llama[:, prompt_ids],
            pooled_embeds=embeds.pooled[prompt_ids],
            return_dict=False,
        )[0]

    def rand(n):
        return torch.rand(n, generator=generator)

    def ground_loss(count: int, min_sigma: float):
        """(grounding loss, its balanced accuracy, flow loss) on `count` cases drawn from its pool, the input
        noised to a level in [min_sigma, 1]."""
        source, target, prompt, labels = ground_pool.sample(count)
        s = (min_sigma + (1 - min_sigma) * rand(count)).view(-1, 1, 1, 1)
        noise = torch.randn(target.shape, generator=generator)
        x_t = (1 - s) * target + s * noise
        out = forward(torch.cat([x_t, source], dim=-1), s.view(-1), prompt)[..., :width]
        return (*grounding.loss(grounding.logits(), labels), torch.nn.functional.mse_loss(out, target - noise))

    if settings.ground_steps:
        # The head alone first (a constant rate, all noise): with the flow loss beside it from the first step,
        # it stayed at chance (docs/lab-notebook.md).
        optimizer = torch.optim.AdamW(parameters, lr=settings.lr, weight_decay=0.0, betas=(0.9, 0.99))
        started, accuracies = time.perf_counter(), []
        for step in range(settings.ground_steps):
            ground_pool.refresh(settings.fresh)
            loss, accuracy, _ = ground_loss(settings.batch, 1.0)
            accuracies.append(accuracy)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(parameters, 1.0)
            optimizer.step()
            if step % settings.log_every == 0 or step == settings.ground_steps - 1:
                elapsed = time.perf_counter() - started
                log(
                    f"grounding step {step + 1}/{settings.ground_steps} loss {float(loss.detach()):.4f} balanced "
                    f"accuracy {np.mean(accuracies[-settings.log_every :]):.3f} ({elapsed:.0f} s)"
                )

    ema = copy.deepcopy(model).requires_grad_(False)
    optimizer = torch.optim.AdamW(parameters, lr=settings.lr, weight_decay=0.0, betas=(0.9, 0.99))
    t0 = time.perf_counter()
    pool = CasePool(settings.pool, encode, seeds, prompt_ids, torch, background_share=settings.background_share)
    log(f"train-tiny: {settings.pool} training cases encoded in {time.perf_counter() - t0:.0f} s")

    started = time.perf_counter()
    accuracies = []
    running = None
    loss_value = float("nan")
    for step in range(settings.steps):
        set_lr(optimizer, settings.lr, step, settings.steps, settings.warmup)
        pool.refresh(settings.fresh)
        # Edit stage: [x_t | source] with the instruction; dropout gives the unconditional / image-only branches.
        source, target, prompt = pool.sample(settings.batch)
        sigma = edit_sigmas(settings, rand)
        noise = torch.randn(target.shape, generator=generator)
        s = sigma.view(-1, 1, 1, 1)
        keep_image = rand(settings.batch) >= settings.image_drop
        keep_text = rand(settings.batch) >= settings.text_drop
        # Content drift. Sampling feeds the model its own slightly wrong x_t; a model that reads the content
        # from x_t (a shortcut: in plain training x_t always agrees with the target) carries those errors to
        # the end, while the right answer given source and instruction does not depend on them. So some
        # noisy inputs get another case's content mixed in ((1 - s) * target + s * drift * (other - target)
        # inside the signal), with the regression target still pointing at this case's clean latent: the
        # extra term is folded into the noise, so x_t + s * (target - noise) stays the clean target.
        drifted = (rand(settings.batch) < settings.drift_share) & keep_image & keep_text
        other = target[torch.randperm(settings.batch, generator=generator)]
        pull = drifted.float() * settings.drift
        if settings.self_drift:
            # Self drift (TrainSettings.self_drift): the content pulled in is the model's own first estimate.
            mine = ((rand(settings.batch) < settings.self_drift) & keep_image & keep_text).nonzero().flatten()
            if len(mine):  # `other` is already a copy (indexing with a permutation): written in place
                other[mine] = own_estimate(forward, source[mine], prompt[mine], width, generator)
                pull[mine] = 1.0
        noise = pulled_noise(noise, target, other, pull, s)
        x_t = (1 - s) * target + s * noise
        source = source * keep_image.float().view(-1, 1, 1, 1)
        prompt = torch.where(keep_text, prompt, torch.full_like(prompt, negative))
        out = forward(torch.cat([x_t, source], dim=-1), sigma, prompt)[..., :width]
        loss = torch.nn.functional.mse_loss(out, target - noise)
        if settings.refine_batch:
            # Refine stage: x_t alone, low noise, the target prompt (E1.1: the instruction) or the negative one.
            source, target, prompt = pool.sample(settings.refine_batch)
            sigma = shifted_sigma(rand(settings.refine_batch) * unshift(REFINE_MAX_SIGMA))
            noise = torch.randn(target.shape, generator=generator)
            s = sigma.view(-1, 1, 1, 1)
            prompt = torch.where(
                rand(settings.refine_batch) < settings.text_drop, torch.full_like(prompt, negative), prompt
            )
            if settings.refine_self_drift:
                # Refine self drift (TrainSettings.refine_self_drift): the content pulled in is the edit stage's
                # estimate of this edit from a higher noise level, which is what the refine stage goes on from.
                mine = (rand(settings.refine_batch) < settings.refine_self_drift) & (prompt != negative)
                mine = mine.nonzero().flatten()
                if len(mine):
                    theirs = target[mine]
                    start = sigma[mine] + (1 - sigma[mine]) * rand(len(mine))
                    level = start.view(-1, 1, 1, 1)
                    noisy = (1 - level) * theirs + level * torch.randn(theirs.shape, generator=generator)
                    estimate = estimate_from(forward, noisy, start, prompt[mine], source[mine])
                    noise[mine] = pulled_noise(noise[mine], theirs, estimate, torch.ones(len(mine)), s[mine])
            out = forward((1 - s) * target + s * noise, sigma, prompt)
            share = settings.refine_batch / (settings.batch + settings.refine_batch)
            loss = (1 - share) * loss + share * torch.nn.functional.mse_loss(out, target - noise)
        flow_value = float(loss.detach())
        if settings.ground_weight or settings.ground_flow:
            ground_pool.refresh(1)
            ground, accuracy, ground_flow = ground_loss(settings.ground_batch, GroundingHead.MIN_SIGMA)
            accuracies.append(accuracy)
            loss = loss + settings.ground_weight * ground + settings.ground_flow * ground_flow
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(parameters, 1.0)
        optimizer.step()
        decay = min(settings.ema, (1 + step) / (10 + step))
        with torch.no_grad():
            for e, p in zip(ema.parameters(), model.parameters()):
                e.lerp_(p, 1 - decay)
        loss_value = flow_value  # the flow-matching loss (the grounding loss is logged beside it)
        running = loss_value if running is None else 0.98 * running + 0.02 * loss_value
        if step % settings.log_every == 0 or step == settings.steps - 1:
            elapsed = time.perf_counter() - started
            grounded = (
                f" grounding balanced accuracy {np.mean(accuracies[-settings.log_every :]):.3f}" if accuracies else ""
            )
            log(
                f"step {step + 1}/{settings.steps} loss {loss_value:.4f} (avg {running:.4f}){grounded} "
                f"lr {optimizer.param_groups[0]['lr']:.2e} ({elapsed:.0f} s, {elapsed / (step + 1):.2f} s/step)"
            )
        if settings.checkpoint_every and (step + 1) % settings.checkpoint_every == 0 and step + 1 < settings.steps:
            save(ema, running, step + 1)
            log(f"train-tiny: checkpoint after {step + 1} steps")
    return model, ema, running if running is not None else loss_value


def pulled_noise(noise, target, other, pull, s):
    """The noise that puts ``x_t = (1 - s) target + s noise'`` on content pulled from `target` towards `other` by
    ``pull x s`` (per sample), while ``x_t + s (target - noise')`` stays exactly `target`: the regression target
    (``target - noise'``) still leads back to this case's clean latent, whatever the input shows."""
    return noise + (pull.view(-1, 1, 1, 1) * (1 - s)) * (other - target)


def own_estimate(forward, source, prompt, width: int, generator):
    """The model's clean estimate of each edit from pure noise (``x_1 = e``, noise level 1), its sources and
    instructions, without gradient: what the first sampling step sees and the later ones commit to."""
    import torch

    pure = torch.randn((*source.shape[:-1], width), generator=generator)
    return estimate_from(forward, pure, torch.ones(len(source)), prompt, source)


def estimate_from(forward, x, level, prompt, source=None):
    """The model's clean estimate from the noisy latents `x` at noise `level` (per sample) with their prompts,
    without gradient: by the edit stage (``[x | source]``) when `source` is given, else by the refine stage."""
    import torch

    width = x.shape[-1]
    with torch.no_grad():
        velocity = forward(x if source is None else torch.cat([x, source], dim=-1), level, prompt)[..., :width]
    return x + level.view(-1, 1, 1, 1) * velocity  # the output is x0 - e, and x = x0 - level * (x0 - e)
