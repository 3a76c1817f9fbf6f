"""The transformer a run trains: diffusers' init with every block starting as the identity, the copy heads that
carry the source to the target from step one, the train/eval mode split, and the training-only grounding head."""

from __future__ import annotations

import math


def make_transformer(spec, seed: int):
    """A fresh transformer of the profile (diffusers' init, adaLN and output layers zeroed so every block
    starts as the identity, but for the copy head: `copy_head_init`), with the max_seq the loader sets for
    E1.1 (the H x 2W edit input)."""
    import torch
    from diffusers import HiDreamImageTransformer2DModel

    torch.manual_seed(seed)
    model = HiDreamImageTransformer2DModel.from_config(spec.transformer_config()).float()
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and ("adaLN_modulation" in name or name.startswith("final_layer")):
                module.weight.zero_()
                if module.bias is not None:
                    module.bias.zero_()
    copy_head_init(model, spec)
    model.max_seq = 2 * spec.max_seq
    return model


# The copy head's rotary pairs (index within an image axis: frequencies 1 and 0.215 rad per token with
# 12 dims per axis), its pair norm before the RMSNorm and the RMSNorm gain: softmax mass ~0.9 on the one key
# (measured by tests/test_tiny_trained.py), which is what the logits' margin over the neighbours gives.
COPY_PAIRS = (0, 1)


COPY_PAIR_NORM = 4.0


COPY_GAIN = 2.0


def copy_heads(spec) -> int:
    """How many heads copy: enough value dims for one latent patch (patch x patch x channels), all but one
    head of the block at most (the other heads start free for the instruction)."""
    patch = spec.patch_size * spec.patch_size * spec.latent_channels
    return max(1, min(-(-patch // spec.attention_head_dim), spec.num_attention_heads - 1))


def copy_head_init(model, spec) -> None:
    """The first `copy_heads(spec)` heads of the first double-stream block start out attending from every
    target token to the source token at the same place (8 latent patches to the right in the
    ``[noisy | source]`` input), and the block's attention gate starts open, so the source reaches the
    target's stream from step one.

    Why: an edit model copies everything the instruction does not touch, and a transformer finds that
    position-to-position pattern slowly on its own (the shipped 2000-step model had not: 15 dB PSNR outside
    the edit). The pattern needs no content, only positions: the head's query and key are constants (their
    projection biases; weights zero) whose rotary pairs are set so that HiDream's RoPE makes the score peak
    at a row offset of 0 and a column offset of +W. Training then keeps, sharpens or undoes it like any
    other weight. Only the initial values change: same classes, same objective."""
    import torch

    block = model.double_stream_blocks[0].block
    attention, head_dim = block.attn1, spec.attention_head_dim
    heads = copy_heads(spec) * head_dim  # the copy heads' rows in to_q / to_k
    axes = spec.axes_dims_rope
    columns = spec.max_resolution[1] // spec.patch_size  # the source token's column offset
    query = torch.zeros(head_dim)
    key = torch.zeros(head_dim)
    for axis, offset in ((1, 0), (2, columns)):  # rows: same row; columns: W to the right
        start = sum(axes[:axis])
        for pair in COPY_PAIRS:
            omega = 10000.0 ** (-2 * pair / axes[axis])
            dim = start + 2 * pair
            q = torch.tensor([COPY_PAIR_NORM / math.sqrt(2), COPY_PAIR_NORM / math.sqrt(2)])
            # RoPE rotates a pair at position p by p * omega; q . R(omega * (d - offset)) q peaks at d = offset.
            angle = -omega * offset
            rotation = torch.tensor([[math.cos(angle), -math.sin(angle)], [math.sin(angle), math.cos(angle)]])
            query[dim : dim + 2], key[dim : dim + 2] = q, rotation @ q
    with torch.no_grad():
        for linear, bias in ((attention.to_q, query), (attention.to_k, key)):
            linear.weight[:heads].zero_()
            linear.bias[:heads] = bias.repeat(heads // head_dim)
        # HiDream's q/k RMSNorm spans all heads (one RMS over them); its gain is per dimension: raised on
        # the copy heads' dims only.
        for norm in (attention.q_rms_norm, attention.k_rms_norm):
            norm.weight[:heads] = COPY_GAIN
        # adaLN chunks: shift, scale, gate of the image attention first; the gate's bias opens it.
        dim = block.adaLN_modulation[-1].out_features // 12
        block.adaLN_modulation[-1].bias[2 * dim : 3 * dim] = 1.0


def training_mode(model) -> None:
    """Top level in eval mode (its forward then unpatchifies like inference), the MoE layers in train mode
    (their inference path routes under no_grad, so routed experts would get no gradient)."""
    model.eval()
    for module in model.modules():
        if type(module).__name__ in ("MOEFeedForwardSwiGLU", "MoEGate"):
            module.train()


class GroundingHead:
    """The training-only grounding head (TrainSettings.ground_*): one linear layer, after a layer norm, on the
    target half's image tokens of one block, which it reads through a forward hook. Not part of the weights."""

    # Noise levels of the cases scored beside the flow loss: where the input shows almost nothing of the answer.
    MIN_SIGMA = 0.9

    def __init__(self, model, spec, block: int, torch):
        self.torch = torch
        self.head = torch.nn.Linear(spec.inner_dim, 1)
        self.rows = spec.max_resolution[0] // spec.patch_size
        self.cols = spec.max_resolution[1] // spec.patch_size
        kept = self.kept = {}
        blocks = [*model.double_stream_blocks, *model.single_stream_blocks]
        if not 0 <= block < len(blocks):
            raise ValueError(f"ground_block {block} is not a block of this transformer (0..{len(blocks) - 1})")

        def keep(module, inputs, output):  # a closure, not a method: copy.deepcopy(model) must not copy the head
            kept["hidden"] = output[0] if isinstance(output, tuple) else output

        blocks[block].register_forward_hook(keep)

    def target_tokens(self, hidden):
        """(B, rows * cols, D) of a block's output: the image tokens come first, row-major over the
        [target | source] input, the first `cols` of each row being the target's."""
        b = hidden.shape[0]
        hidden = hidden[:, : self.rows * 2 * self.cols].reshape(b, self.rows, 2 * self.cols, -1)[:, :, : self.cols]
        return hidden.reshape(b, self.rows * self.cols, -1)

    def logits(self):
        """The head's logits of the last forward's target tokens, (B, rows * cols)."""
        hidden = self.target_tokens(self.kept.pop("hidden"))
        return self.head(self.torch.nn.functional.layer_norm(hidden, hidden.shape[-1:]))[..., 0]

    def loss(self, logits, labels):
        """Class-balanced cross-entropy over each image's shape tokens, and its balanced accuracy."""
        torch = self.torch
        named, scored = labels[:, 0], labels[:, 1]
        bce = torch.nn.functional.binary_cross_entropy_with_logits(logits, named, reduction="none")
        positives = (named * scored).sum(1).clamp(min=1)
        negatives = ((1 - named) * scored).sum(1).clamp(min=1)
        loss = 0.5 * ((bce * named * scored).sum(1) / positives + (bce * (1 - named) * scored).sum(1) / negatives)
        with torch.no_grad():
            hit = (logits > 0).float()
            accuracy = 0.5 * (
                (hit * named * scored).sum(1) / positives + ((1 - hit) * (1 - named) * scored).sum(1) / negatives
            )
        return loss.mean(), float(accuracy.mean())
