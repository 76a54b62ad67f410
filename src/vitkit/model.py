"""The Vision Transformer, as equations 1-4 of Dosovitskiy et al. (ICLR 2021) define it.

    z_0  = [x_class; x_p^1 E; ...; x_p^N E] + E_pos                    (1)
    z'_l = MSA(LN(z_{l-1})) + z_{l-1}                                  (2)
    z_l  = MLP(LN(z'_l)) + z'_l                                        (3)
    y    = LN(z_L^0)                                                   (4)

Parameter names follow timm's `VisionTransformer`, so that timm checkpoints load with an identity mapping
and the other formats with a thin, asserted one (see `vitkit.convert`).
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from .attention import Attention
from .config import ViTConfig, check_image_batch, gap_drops_class_token, get_config, patches_kept
from .features import OUTPUT_FORMATS, block_indices, split_tokens
from .hub_mixin import HubMixin
from .hybrid import HybridEmbed
from .init import lecun_normal_, mimetic_init_
from .lsa import LocalitySelfAttention
from .posemb import resample_pos_embed, sincos_position_table
from .spt import ShiftedPatchEmbed
from .streams import bits, fold_in, uniform


class PatchEmbed(nn.Module):
    """x_p E of eq. 1: a convolution with kernel = stride = P is the linear map E of each flattened patch."""

    def __init__(self, cfg: ViTConfig):
        super().__init__()
        self.proj = nn.Conv2d(cfg.in_chans, cfg.dim, kernel_size=cfg.patch_size, stride=cfg.patch_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj(x)  # (B, D, gh, gw)
        return x.flatten(2).transpose(1, 2)  # (B, N, D), patches in raster order


def build_patch_embed(cfg: ViTConfig) -> nn.Module:
    """The patch embedding x_p E of eq. 1: of the image's patches, or of a ResNet's feature map (the hybrid,
    Sec. 3.1); with `cfg.spt`, of the patches and their shifted copies (vitkit.spt, not the paper's)."""
    if cfg.hybrid_layers is not None:
        return HybridEmbed(cfg)
    return ShiftedPatchEmbed(cfg) if cfg.spt else PatchEmbed(cfg)


def build_attention(cfg: ViTConfig) -> Attention:
    """Eq. 2's MSA; with `cfg.lsa`, Locality Self-Attention (vitkit.lsa, not the paper's)."""
    return LocalitySelfAttention(cfg) if cfg.lsa else Attention(cfg)


class Mlp(nn.Module):
    """The MLP of eq. 3: D -> mlp_dim -> D with a GELU between."""

    def __init__(self, cfg: ViTConfig):
        super().__init__()
        self.fc1 = nn.Linear(cfg.dim, cfg.mlp_dim)
        self.act = nn.GELU(approximate="tanh" if cfg.gelu == "tanh" else "none")
        self.fc2 = nn.Linear(cfg.mlp_dim, cfg.dim)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.fc2(self.drop(self.act(self.fc1(x)))))


def drop_path(x: torch.Tensor, p: float, training: bool, stream: torch.Tensor | None = None) -> torch.Tensor:
    """Stochastic depth: drop a residual branch for a whole sample with probability p, rescale the rest. The
    draws come from each image's `stream` ((B, 2), vitkit.streams) when given, else from torch's generator."""
    if p == 0.0 or not training:
        return x
    shape = (x.shape[0],) + (1,) * (x.dim() - 1)
    if stream is None:
        keep = x.new_empty(shape).bernoulli_(1.0 - p)
    else:
        keep = (uniform(stream, 1) >= p).to(x.dtype).view(shape)
    return x * keep.div_(1.0 - p)  # rescale the (B, 1, 1) mask, not the (B, T, D) x: one pass over x


def patch_dropout(x: torch.Tensor, p: float, num_prefix: int, training: bool,
                  stream: torch.Tensor | None = None) -> torch.Tensor:
    """PatchDropout: keep the `num_prefix` leading tokens (class token) and a random round((1 - p) N) of the N
    patch tokens of each image, in their original order. (B, prefix + N, D) -> (B, prefix + kept, D). The
    draws come from each image's `stream` ((B, 2), vitkit.streams) when given, else from torch's generator."""
    if p == 0.0 or not training:
        return x
    B, T, D = x.shape
    n = T - num_prefix
    keep = patches_kept(p, n)
    scores = torch.rand(B, n, device=x.device) if stream is None else bits(stream, n)
    idx = scores.argsort(dim=1, stable=True)[:, :keep].sort(dim=1).values + num_prefix
    patches = x.gather(1, idx.unsqueeze(-1).expand(-1, -1, D))
    return torch.cat([x[:, :num_prefix], patches], dim=1)


class Block(nn.Module):
    """One pre-LayerNorm encoder block: eq. 2 then eq. 3."""

    def __init__(self, cfg: ViTConfig, drop_path: float = 0.0):
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.dim, eps=cfg.ln_eps)
        self.attn = build_attention(cfg)
        self.norm2 = nn.LayerNorm(cfg.dim, eps=cfg.ln_eps)
        self.mlp = Mlp(cfg)
        self.drop_path = drop_path

    def forward(self, x: torch.Tensor, return_attention: bool = False, queries: int | None = None,
                stream: torch.Tensor | None = None):
        """(B, T, D) -> (B, T, D); with `queries`, only the first `queries` tokens are updated: (B, queries,
        D). `stream`: each image's random stream for drop-path (see VisionTransformer.forward)."""
        y, attn = self.attn(self.norm1(x), return_attention, queries)
        if queries is not None:
            x = x[:, :queries]
        # the streams of the two branches, made only where a mask is drawn (an eager forward's small ops)
        s2, s3 = ((fold_in(stream, 2), fold_in(stream, 3)) if stream is not None and self.training
                  and self.drop_path > 0 else (None, None))
        x = x + drop_path(y, self.drop_path, self.training, s2)  # (2)
        x = x + drop_path(self.mlp(self.norm2(x)), self.drop_path, self.training, s3)  # (3)
        return x, attn


class VisionTransformer(nn.Module, HubMixin):
    """The ViT of `cfg`: eq. 1 (`embed`), the encoder blocks (eq. 2-3) and the final LayerNorm (eq. 4) in
    `forward_features`, pooling and head in `forward_head`.

    `forward` runs every token through every block (vitkit.accelerate and vitkit.optimize swap in the
    class-token shortcut, vitkit.shortcut). A block returns (tokens, attention or None), so
    `nn.Sequential(*model.blocks)` does not chain them. The Hub's from_pretrained / save_pretrained /
    push_to_hub come from vitkit.hub_mixin.

    In training, drop-path and PatchDropout draw from torch's generator, or, given `streams` ((B, 2) int64,
    vitkit.streams), from each image's own stream: vitkit's trainer keys them by the image's place in the
    global batch, so that an image's masks do not depend on the process or micro-batch it falls in. Dropout
    always draws from torch's generator.

    With cfg.distilled, DeiT's distillation token follows the class token and has its own head (`head_dist`):
    the logits are the mean of the two heads', or, in training after set_distilled_training(), the pair
    (class head, distillation head) for a distillation loss."""

    def __init__(self, cfg: ViTConfig):
        super().__init__()
        self.cfg = cfg
        D = cfg.dim
        # The PatchDropout rate in training; a training loop may change it (e.g. to 0 for the last epochs).
        self.patch_drop_rate = cfg.patch_dropout
        self.grad_checkpointing = False  # set_grad_checkpointing
        self.patch_embed = build_patch_embed(cfg)
        # Eq. 1: the learnable class token whose final state is the image representation.
        self.cls_token = nn.Parameter(torch.zeros(1, 1, D)) if cfg.class_token else None
        self.dist_token = nn.Parameter(torch.zeros(1, 1, D)) if cfg.distilled else None
        self.distilled_training = False  # set_distilled_training
        self.pos_embed = None
        if cfg.pos_embed == "learned":  # 1D: one row per token (N+1 rows with the class token)
            self.pos_embed = nn.Parameter(torch.zeros(1, cfg.num_tokens, D))
        elif cfg.pos_embed == "learned-2d":  # D.4: a row half and a column half, concatenated per patch
            gh, gw = cfg.grid_size
            self.pos_embed_row = nn.Parameter(torch.zeros(1, gh, D // 2))
            self.pos_embed_col = nn.Parameter(torch.zeros(1, gw, D // 2))
            if cfg.class_token:
                self.pos_embed_cls = nn.Parameter(torch.zeros(1, cfg.num_prefix_tokens, D))
        elif cfg.pos_embed == "sincos-2d":  # fixed, so a buffer; the class token gets no position
            self.register_buffer("pos_embed_fixed", sincos_position_table(cfg.grid_size, D,
                                                                          cfg.num_prefix_tokens),
                                 persistent=False)
        self.pos_drop = nn.Dropout(cfg.dropout)
        # Stochastic depth grows linearly with depth, as in DeiT and timm.
        rates = [cfg.drop_path * i / max(cfg.depth - 1, 1) for i in range(cfg.depth)]
        self.blocks = nn.ModuleList([Block(cfg, rates[i]) for i in range(cfg.depth)])
        self.norm = nn.LayerNorm(D, eps=cfg.ln_eps)  # eq. 4
        # Pre-training head: one hidden layer with tanh; fine-tuning head: a single (zero-init) linear layer.
        self.pre_logits = nn.Linear(D, cfg.representation_size) if cfg.representation_size else None
        head_in = cfg.representation_size or D
        self.head = nn.Linear(head_in, cfg.num_classes) if cfg.num_classes > 0 else nn.Identity()
        self.head_dist = None  # DeiT's head on the distillation token
        if cfg.distilled:
            self.head_dist = nn.Linear(D, cfg.num_classes) if cfg.num_classes > 0 else nn.Identity()
        self.init_weights()

    # --- initialisation, as the reference (Flax) code ---------------------------------------------
    def init_weights(self) -> None:
        """The initialisation of Google's Flax ViT (vit_jax/models_vit.py): a zero class token, normal (std
        0.02) position embeddings, LeCun normal for the patch projection and the pre-logits, Xavier uniform in
        the encoder, a zero classifier. A model on the meta device (shapes only: count_parameters,
        count_flops) has no values to set."""
        if self.norm.weight.is_meta:
            return
        for name in ("pos_embed", "pos_embed_row", "pos_embed_col", "pos_embed_cls"):
            if getattr(self, name, None) is not None:
                nn.init.normal_(getattr(self, name), std=0.02)  # AddPositionEmbs: normal(0.02), "from BERT"
        if self.cls_token is not None:
            nn.init.zeros_(self.cls_token)
        if self.dist_token is not None:
            nn.init.normal_(self.dist_token, std=0.02)  # DeiT's; a zero one would start as the class token
        if isinstance(self.patch_embed, (PatchEmbed, ShiftedPatchEmbed)):
            # The patch projection is the linear map E of the flattened patch: LeCun normal over its fan-in.
            lecun_normal_(self.patch_embed.proj.weight)
            nn.init.zeros_(self.patch_embed.proj.bias)
        for name, m in self.named_modules():
            if isinstance(m, nn.Linear) and name.startswith("blocks."):
                if name.endswith("attn.qkv"):
                    # Flax has separate D -> D query, key and value maps: Xavier over each third, not over
                    # the fused (3D, D) matrix whose fan-out would be three times too large.
                    for w in m.weight.chunk(3, dim=0):
                        nn.init.xavier_uniform_(w)
                else:
                    nn.init.xavier_uniform_(m.weight)  # Flax Dense in the encoder: Xavier uniform
                if name.endswith(("mlp.fc1", "mlp.fc2")):
                    nn.init.normal_(m.bias, std=1e-6)  # Flax MlpBlock's bias_init
                elif m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.LayerNorm):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
        if self.cfg.attn_init == "mimetic":
            for block in self.blocks:
                mimetic_init_(block.attn)
        if self.pre_logits is not None:
            lecun_normal_(self.pre_logits.weight)  # Flax Dense's default kernel init
            nn.init.zeros_(self.pre_logits.bias)
        for head in (self.head, self.head_dist):
            if isinstance(head, nn.Linear):
                nn.init.zeros_(head.weight)  # the paper's zero-initialised classifier
                nn.init.zeros_(head.bias)

    # --- position embedding --------------------------------------------------------------------------
    def position_table(self, grid: tuple[int, int] | None = None) -> torch.Tensor | None:
        """E_pos as a (1, tokens, D) table, whatever its parameterisation (learned, learned-2d halves
        concatenated, fixed sin-cos); None for pos_embed='none'. For another `grid` of patches than the
        configured one (dynamic_img_size): the learned tables resampled to it, the sin-cos one made for it."""
        cfg = self.cfg
        if grid is not None and tuple(grid) != cfg.grid_size:
            if cfg.pos_embed == "sincos-2d":
                table = sincos_position_table(tuple(grid), cfg.dim, cfg.num_prefix_tokens)
                return table.to(self.pos_embed_fixed)
            table = self.position_table()
            if table is None:
                return None
            return resample_pos_embed(table, cfg.grid_size, grid, cfg.num_prefix_tokens)
        if cfg.pos_embed == "learned":
            return self.pos_embed
        if cfg.pos_embed == "sincos-2d":
            return self.pos_embed_fixed
        if cfg.pos_embed == "learned-2d":
            gh, gw = cfg.grid_size
            row = self.pos_embed_row[:, :, None, :].expand(-1, gh, gw, -1)
            col = self.pos_embed_col[:, None, :, :].expand(-1, gh, gw, -1)
            table = torch.cat([row, col], dim=-1).reshape(1, gh * gw, cfg.dim)
            if cfg.class_token:
                table = torch.cat([self.pos_embed_cls, table], dim=1)
            return table
        return None

    # --- forward ----------------------------------------------------------------------------------
    def embed(self, x: torch.Tensor, streams: torch.Tensor | None = None) -> torch.Tensor:
        """Eq. 1: patches, class token, position embedding. (B, C, H, W) -> (B, T, D); in training with
        PatchDropout (rate `self.patch_drop_rate`, from cfg.patch_dropout), fewer patch tokens."""
        grid = self.image_grid(x)
        x = self.patch_embed(x)  # (B, N, D)
        prefix = [t.expand(x.shape[0], -1, -1) for t in (self.cls_token, self.dist_token) if t is not None]
        if prefix:
            x = torch.cat([*prefix, x], dim=1)  # (B, N+1, D), or N+2 with a distillation token
        pos = self.position_table(grid)
        if pos is not None:
            x = x + pos
        drawn = streams is not None and self.training and self.patch_drop_rate > 0
        x = patch_dropout(x, self.patch_drop_rate, self.cfg.num_prefix_tokens, self.training,
                          fold_in(streams, 0) if drawn else None)
        return self.pos_drop(x)

    def image_grid(self, x: torch.Tensor) -> tuple[int, int]:
        """The grid of patches of the batch `x`, after checking that the model takes it: images of the
        configured size, or of any multiple of the patch stride with dynamic_img_size."""
        cfg, stride = self.cfg, self.cfg.patch_stride
        check_image_batch(tuple(x.shape), cfg.in_chans, cfg.image_size,
                          any_multiple_of=stride if cfg.dynamic_img_size else None)
        return x.shape[-2] // stride, x.shape[-1] // stride

    def block_stream(self, streams: torch.Tensor | None, i: int) -> torch.Tensor | None:
        """Block i's random streams, derived from the model's; None without them, or where the block draws no
        mask (in evaluation, or at drop-path rate 0: the first block's)."""
        if streams is None or not self.training or self.blocks[i].drop_path == 0:
            return None
        return fold_in(streams, 1 + i)

    def run_block(self, i: int, x: torch.Tensor, streams: torch.Tensor | None, return_attention: bool = False,
                  queries: int | None = None):
        """Block i on x, with its random streams; under set_grad_checkpointing (and autograd on), its
        activations are recomputed in the backward pass instead of kept."""
        block, stream = self.blocks[i], self.block_stream(streams, i)
        if self.grad_checkpointing and torch.is_grad_enabled():
            # dropout is replayed from the saved generator state; drop-path and PatchDropout from the streams
            return checkpoint(block, x, return_attention, queries, stream, use_reentrant=False)
        return block(x, return_attention, queries, stream)

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """Activation checkpointing per block (timm's name): keep only each block's input in the forward
        pass and recompute the rest in the backward one. The same gradients, for the memory of one block's
        activations instead of all of them, at the cost of a second forward pass of the blocks."""
        self.grad_checkpointing = enable

    def forward_features(self, x: torch.Tensor, return_attention: bool = False,
                         streams: torch.Tensor | None = None):
        """All tokens after the final LayerNorm, (B, T, D); with return_attention, also every block's
        attention weights, a list of (B, heads, T, T)."""
        x = self.embed(x, streams)
        attentions = []
        for i in range(len(self.blocks)):
            x, attn = self.run_block(i, x, streams, return_attention)  # (2), (3)
            attentions.append(attn)
        x = self.norm(x)  # (4), applied to every token so that GAP and the analyses see normalised tokens
        return (x, attentions) if return_attention else x

    def pool(self, features: torch.Tensor) -> torch.Tensor:
        """The image representation y: the class token's state, or the mean of the patch tokens (GAP)."""
        if self.cfg.pool == "token":
            return features[:, 0]
        return features[:, self.cfg.num_prefix_tokens:].mean(dim=1)

    def forward_head(self, features: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        """Logits from forward_features' output; with pre_logits, the representation fed to the classifier."""
        if self.cfg.distilled:
            return self.distilled_head(features, pre_logits)
        x = self.pool(features)  # (B, D)
        if self.pre_logits is not None:
            x = torch.tanh(self.pre_logits(x))
        return x if pre_logits else self.head(x)

    def distilled_head(self, features: torch.Tensor, pre_logits: bool = False):
        """DeiT's two heads, on the class token and on the distillation token: their mean (timm's
        VisionTransformerDistilled), or the pair in training after set_distilled_training()."""
        x, x_dist = features[:, 0], features[:, 1]
        if pre_logits:
            return (x + x_dist) / 2
        x, x_dist = self.head(x), self.head_dist(x_dist)
        return (x, x_dist) if self.distilled_training and self.training else (x + x_dist) / 2

    def set_distilled_training(self, enable: bool = True) -> None:
        """Whether forward returns (class logits, distillation logits) in training (timm's name)."""
        self.distilled_training = enable

    def forward_intermediates(self, x: torch.Tensor, indices: int | list[int] | None = None,
                              return_prefix_tokens: bool = False, norm: bool = False,
                              stop_early: bool = False, output_fmt: str = "NCHW",
                              intermediates_only: bool = False):
        """The tokens after chosen blocks (timm's API), `indices` as vitkit.features.block_indices reads
        it: each a map (B, D, gh, gw) ('NCHW') or (B, gh gw, D) ('NLC') of the patch tokens, with the final
        LayerNorm if `norm`, paired with the prefix (class) tokens if `return_prefix_tokens`. Returns the
        list, or (the final features, the list): forward_features' output, or with `stop_early` that of
        the last block asked for."""
        if output_fmt not in OUTPUT_FORMATS:
            raise ValueError(f"output_fmt={output_fmt!r}: choose from {', '.join(OUTPUT_FORMATS)}")
        take = block_indices(indices, len(self.blocks))
        grid = self.image_grid(x)
        x = self.embed(x)
        out = []
        for i in range(take[-1] + 1 if stop_early or intermediates_only else len(self.blocks)):
            x, _ = self.run_block(i, x, None)
            if i in take:
                patches, prefix = split_tokens(self.norm(x) if norm else x, self.cfg.num_prefix_tokens, grid,
                                               output_fmt)
                out.append((patches, prefix) if return_prefix_tokens else patches)
        return out if intermediates_only else (self.norm(x), out)

    def get_intermediate_layers(self, x: torch.Tensor, n: int | list[int] = 1, reshape: bool = False,
                                return_prefix_tokens: bool = False, norm: bool = False) -> tuple:
        """The patch tokens of the last `n` blocks (or of the blocks listed), (B, gh gw, D) or with `reshape`
        (B, D, gh, gw): timm's and DINO's call."""
        return tuple(self.forward_intermediates(x, n, return_prefix_tokens, norm, True,
                                                "NCHW" if reshape else "NLC", intermediates_only=True))

    def forward(self, x: torch.Tensor, streams: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (B, num_classes): eqs. 1-4, every token through every block. (vitkit.accelerate and
        vitkit.optimize swap in a forward that updates only the class token in the last block:
        vitkit.shortcut.)"""
        return self.forward_head(self.forward_features(x, streams=streams))

    # --- utilities --------------------------------------------------------------------------------
    def reset_classifier(self, num_classes: int, global_pool: str | None = None) -> None:
        """A new zero-initialised classifier for `num_classes` (0: none, the representation is the output),
        as for fine-tuning; `global_pool` ('token', or 'gap'/'avg') changes the pooling too. The config
        follows."""
        pool = {"avg": "gap"}.get(global_pool, global_pool) or self.cfg.pool
        cfg = self.cfg.replace(num_classes=num_classes, pool=pool)  # validated: 'token' needs a class token
        like = self.head.weight if isinstance(self.head, nn.Linear) else self.norm.weight
        for name in ("head", "head_dist") if cfg.distilled else ("head",):
            head = nn.Linear(cfg.representation_size or cfg.dim, num_classes, device=like.device,
                             dtype=like.dtype) if num_classes > 0 else nn.Identity()
            if num_classes > 0 and not like.is_meta:
                nn.init.zeros_(head.weight)
                nn.init.zeros_(head.bias)
            setattr(self, name, head)
        self.cfg = cfg

    def no_weight_decay(self) -> set[str]:
        """Parameters that weight decay should skip, besides biases and norms: the embeddings."""
        embeddings = ("pos_embed", "cls_token", "dist_token")
        return {n for n, _ in self.named_parameters() if n.startswith(embeddings)}


def create_model(name: str | ViTConfig, **overrides) -> VisionTransformer:
    """Build a randomly initialised ViT from a preset name ("ViT-B/16", "vit_base_patch16_224") or a config.

    Overrides replace config fields, e.g. `create_model("ViT-S/16", num_classes=10, image_size=384)`.
    """
    if isinstance(name, ViTConfig):
        if gap_drops_class_token(overrides):
            overrides["class_token"] = False
        cfg = name.replace(**overrides) if overrides else name
    else:
        cfg = get_config(name, **overrides)
    return VisionTransformer(cfg)
