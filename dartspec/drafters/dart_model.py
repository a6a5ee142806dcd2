"""The DART drafter network: one light decoder layer over fused target features plus mask slots.

Per real position i the layer input pairs ``fc(h_i)`` (the target's hidden states entering the
feature layers, concatenated, projected 3H -> H) with the target's embedding of the *next* token
x_{i+1}; both are RMS-normed and concatenated to 2H. After the last real position come d-1 learned
mask slots at consecutive positions. Attention is causal over [context ; masks], and the d output
rows (last real position, then the masks) give logits for depths 1..d below the tree root, over a
reduced draft vocabulary mapped back to target ids by ``d2t`` (method.md section 2).

Saved as ``config.json`` + ``model.safetensors`` (no pickle). The target's embedding table is used
frozen and is not part of the checkpoint.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dartspec.atomic import atomic_path, write_text
from dartspec.errors import DartspecError
from dartspec.runtime import attention_kernels

FORMAT = "dartspec-dart"
FORMAT_VERSION = 1


@dataclass(frozen=True)
class DartConfig:
    """Shapes of a DART drafter; target-dependent sizes come from the target's config."""

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    draft_vocab_size: int
    target_vocab_size: int
    feature_layers: tuple[int, ...]
    depth: int = 8
    num_layers: int = 1
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    target_name: str = ""
    #: Identifies the target (tokenizer + shapes) so a drafter is never used with the wrong model.
    target_fingerprint: str = ""
    format: str = FORMAT
    format_version: int = FORMAT_VERSION
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "feature_layers", tuple(int(i) for i in self.feature_layers))
        if self.depth < 1 or self.num_layers < 1 or self.draft_vocab_size < 2:
            raise DartspecError("DART config needs depth >= 1, num_layers >= 1 and a draft vocabulary of >= 2 tokens")
        if self.draft_vocab_size > self.target_vocab_size:
            raise DartspecError("the draft vocabulary cannot be larger than the target's")
        if self.num_attention_heads % self.num_key_value_heads:
            raise DartspecError("num_attention_heads must be a multiple of num_key_value_heads")

    @classmethod
    def for_target(cls, target: Any, *, draft_vocab_size: int, depth: int = 8, num_layers: int = 1) -> DartConfig:
        """Sizes from a :class:`~dartspec.target.Target` (hidden size, heads, MLP width, RoPE base)."""
        cfg = target.config
        heads = int(cfg.num_attention_heads)
        rope = getattr(cfg, "rope_parameters", None) or {}
        theta = float(rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))
        return cls(
            hidden_size=target.hidden_size,
            num_attention_heads=heads,
            num_key_value_heads=int(getattr(cfg, "num_key_value_heads", heads) or heads),
            head_dim=int(getattr(cfg, "head_dim", None) or target.hidden_size // heads),
            intermediate_size=int(cfg.intermediate_size),
            draft_vocab_size=min(draft_vocab_size, target.vocab_size),
            target_vocab_size=target.vocab_size,
            feature_layers=target.feature_layers,
            depth=depth,
            num_layers=num_layers,
            rms_norm_eps=float(getattr(cfg, "rms_norm_eps", 1e-6)),
            rope_theta=theta,
            target_name=target.name,
            target_fingerprint=target_fingerprint(target),
        )

    def to_json(self) -> str:
        data = asdict(self)
        data["feature_layers"] = list(self.feature_layers)
        return json.dumps(data, indent=2)

    @classmethod
    def from_json(cls, text: str, origin: str = "config.json", expected_format: str = FORMAT) -> DartConfig:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise DartspecError(f"{origin} is not valid JSON ({err.msg}); the checkpoint is corrupted") from None
        if not isinstance(data, dict) or data.get("format") != expected_format:
            found = data.get("format") if isinstance(data, dict) else None
            raise DartspecError(
                f"{origin} is not a {expected_format!r} drafter config"
                + (f" (it is {found!r}: pass it to the matching --drafter)" if found else "")
            )
        if data.get("format_version", 0) > FORMAT_VERSION:
            raise DartspecError(f"{origin} was written by a newer dartspec (format {data['format_version']})")
        known = {f.name for f in fields(cls)}
        try:
            return cls(**{k: v for k, v in data.items() if k in known})
        except TypeError as err:
            raise DartspecError(f"{origin} is missing fields: {err}") from None


def _vocab(target: Any) -> dict[str, int]:
    """The target's vocabulary: listed once by a runtime (``CausalRuntime.vocab``), else by its tokenizer."""
    if hasattr(target, "vocab"):
        return target.vocab
    return target.tokenizer.get_vocab() if target.tokenizer is not None else {}


def target_fingerprint(target: Any) -> str:
    """A short identity of the target: vocabulary, hidden size, layers (not the weights)."""
    import hashlib
    import heapq

    h = hashlib.sha256()
    h.update(f"{target.vocab_size}/{target.hidden_size}/{target.num_layers}".encode())
    vocab = _vocab(target)
    for tok, idx in heapq.nsmallest(4096, vocab.items(), key=lambda kv: kv[1]):  # = sorted(...)[:4096], faster
        h.update(f"{idx}:{tok}\n".encode())
    return h.hexdigest()[:16]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def rotary(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Llama-style RoPE (rotate halves) on ``(..., heads, N, head_dim)`` at integer ``positions (..., N)``."""
    half = x.shape[-1] // 2
    inv = 1.0 / (theta ** (torch.arange(half, device=x.device, dtype=torch.float32) / half))
    angles = (positions.to(torch.float32)[..., None] * inv).unsqueeze(-3)  # (..., 1, N, half): every head
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Attention of ``q (..., heads, N, D)`` over ``k``, ``v`` ``(..., kv_heads, L, D)``, each KV head repeated for
    its query heads, under ``mask (..., N, L)`` bool (None: everything); on a GPU in
    :func:`dartspec.runtime.attention_kernels` (training's and drafting's shapes change every step)."""
    rep = q.shape[-3] // k.shape[-3]
    with attention_kernels(q.device):
        return F.scaled_dot_product_attention(
            q,
            k.repeat_interleave(rep, dim=-3),
            v.repeat_interleave(rep, dim=-3),
            attn_mask=None if mask is None else mask.unsqueeze(-3),
        )


@dataclass
class DraftKV:
    """Keys and values of committed real positions, one ``(..., kv_heads, L, head_dim)`` pair per layer (leading
    dimensions: a batch of sequences, as training unrolls them)."""

    keys: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)

    @property
    def length(self) -> int:
        return self.keys[0].shape[-2] if self.keys else 0

    def append(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Add positions' ``(..., kv_heads, n, head_dim)`` keys and values to ``layer`` (layers are filled in
        order)."""
        if len(self.keys) > layer:
            self.keys[layer] = torch.cat([self.keys[layer], keys], dim=-2)
            self.values[layer] = torch.cat([self.values[layer], values], dim=-2)
        else:
            self.keys.append(keys.contiguous())
            self.values.append(values.contiguous())


class DraftLayer(nn.Module):
    """A Llama-style decoder layer whose attention may read a wider (2H) input than its residual (H)."""

    def __init__(self, cfg: DartConfig, in_dim: int) -> None:
        super().__init__()
        H, hd = cfg.hidden_size, cfg.head_dim
        self.cfg = cfg
        self.q_proj = nn.Linear(in_dim, cfg.num_attention_heads * hd, bias=False)
        self.k_proj = nn.Linear(in_dim, cfg.num_key_value_heads * hd, bias=False)
        self.v_proj = nn.Linear(in_dim, cfg.num_key_value_heads * hd, bias=False)
        self.o_proj = nn.Linear(cfg.num_attention_heads * hd, H, bias=False)
        self.post_norm = RMSNorm(H, cfg.rms_norm_eps)
        self.gate_proj = nn.Linear(H, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(H, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, H, bias=False)

    def forward(
        self,
        x_in: torch.Tensor,
        resid: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor,
        past: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x_in (..., N, in_dim)``, ``resid (..., N, H)``; ``mask (..., N, L+N)`` bool over [past ; new].

        Leading dimensions are a batch of independent sequences (training packs many in one forward);
        drafting passes one sequence without them. Returns the residual stream and the new keys/values
        ``(..., kv_heads, N, head_dim)``.
        """
        q, k, v = self.project(x_in, positions)
        if past is not None:
            k_all = torch.cat([past[0], k], dim=-2)
            v_all = torch.cat([past[1], v], dim=-2)
        else:
            k_all, v_all = k, v
        return self.mix(q, k_all, v_all, mask, resid), k, v

    def project(self, x_in: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries, keys and values ``(..., heads, N, head_dim)`` of the new inputs, rotated to ``positions``."""
        cfg = self.cfg

        def heads(x: torch.Tensor, count: int) -> torch.Tensor:
            return x.unflatten(-1, (count, cfg.head_dim)).transpose(-2, -3)

        q = rotary(heads(self.q_proj(x_in), cfg.num_attention_heads), positions, cfg.rope_theta)
        k = rotary(heads(self.k_proj(x_in), cfg.num_key_value_heads), positions, cfg.rope_theta)
        return q, k, heads(self.v_proj(x_in), cfg.num_key_value_heads)

    def mix(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None, resid: torch.Tensor
    ) -> torch.Tensor:
        """The residual stream after attention of ``q`` over ``keys``/``values`` under ``mask`` and the MLP."""
        attn = attend(q, keys, values, mask)
        h = resid + self.o_proj(attn.transpose(-2, -3).flatten(-2))
        x = self.post_norm(h)
        return h + self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DartModel(nn.Module):
    """The DART drafter network (see module docstring)."""

    #: ``format`` of the checkpoints this class reads and writes.
    FORMAT = FORMAT

    def __init__(self, cfg: DartConfig) -> None:
        super().__init__()
        H = cfg.hidden_size
        self.cfg = cfg
        self.fc = nn.Linear(len(cfg.feature_layers) * H, H, bias=False)
        self.norm_feat = RMSNorm(H, cfg.rms_norm_eps)
        self.norm_embed = RMSNorm(H, cfg.rms_norm_eps)
        self.mask_input = nn.Parameter(torch.randn(2 * H) * 0.02)
        self.mask_resid = nn.Parameter(torch.zeros(H))
        self.layers = nn.ModuleList([DraftLayer(cfg, 2 * H if i == 0 else H) for i in range(cfg.num_layers)])
        self.input_norms = nn.ModuleList([RMSNorm(H, cfg.rms_norm_eps) for _ in range(cfg.num_layers - 1)])
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(H, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.arange(cfg.draft_vocab_size, dtype=torch.long), persistent=True)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=0.02)

    # --- inputs ----------------------------------------------------------------------------------

    def real_inputs(self, features: torch.Tensor, next_embeds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer input ``(m, 2H)`` and residual ``(m, H)`` for real positions."""
        h = self.fc(features)
        return torch.cat([self.norm_feat(h), self.norm_embed(next_embeds)], dim=-1), h

    def mask_inputs(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer input and residual for ``n`` mask slots."""
        return self.mask_input.expand(n, -1), self.mask_resid.expand(n, -1)

    # --- forward ---------------------------------------------------------------------------------

    def forward(
        self,
        x_in: torch.Tensor,
        resid: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor,
        cache: DraftKV | None = None,
        keep: int = 0,
    ) -> torch.Tensor:
        """Final-norm hidden states ``(N, H)`` for N inputs attending to ``cache`` + themselves via ``mask``.

        If ``cache`` is given, the keys/values of the first ``keep`` new inputs are appended to it.
        """
        return self.norm(self.residual(x_in, resid, positions, mask, cache, keep))

    def residual(
        self,
        x_in: torch.Tensor,
        resid: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor,
        cache: DraftKV | None = None,
        keep: int = 0,
        tree: DraftKV | None = None,
    ) -> torch.Tensor:
        """Like :meth:`forward` but the residual stream before the final norm.

        ``tree`` (autoregressive drafters) holds the keys/values of draft-tree nodes, attended to after
        ``cache``; the new inputs' keys/values are appended to it, since they are tree nodes too.
        """
        h = resid
        x = x_in
        for i, layer in enumerate(self.layers):
            if i > 0:
                x = self.input_norms[i - 1](h)
            past = (cache.keys[i], cache.values[i]) if cache is not None and len(cache.keys) > i else None
            if tree is not None and len(tree.keys) > i:
                more = (tree.keys[i], tree.values[i])
                past = more if past is None else (torch.cat([past[0], more[0]], -2), torch.cat([past[1], more[1]], -2))
            h, k, v = layer(x, h, positions, mask, past)
            if cache is not None and keep:
                cache.append(i, k[..., :keep, :], v[..., :keep, :])
            if tree is not None:
                tree.append(i, k, v)
        return h

    @torch.inference_mode()
    def step(
        self,
        features: torch.Tensor,
        next_embeds: torch.Tensor,
        start: int,
        cache: DraftKV,
        depth: int | None = None,
    ) -> torch.Tensor:
        """One drafting forward: m new real positions (from ``start``) + masks; log-probs ``(depth, Vd)``.

        The real positions' keys/values are appended to ``cache``; the masks' are dropped, so the cache
        only ever holds committed context.
        """
        depth = self.cfg.depth if depth is None else max(1, min(depth, self.cfg.depth))
        m = features.shape[0]
        x_r, h_r = self.real_inputs(features, next_embeds)
        x_m, h_m = self.mask_inputs(depth - 1)
        x_in = torch.cat([x_r, x_m.to(x_r.dtype)])
        resid = torch.cat([h_r, h_m.to(h_r.dtype)])
        n = m + depth - 1
        past = cache.length
        positions = torch.arange(start, start + n, device=features.device)
        mask = torch.ones(n, past + n, dtype=torch.bool, device=features.device)
        mask[:, past:] = torch.ones(n, n, dtype=torch.bool, device=features.device).tril_()
        hidden = self.forward(x_in, resid, positions, mask, cache=cache, keep=m)
        logits = self.lm_head(hidden[m - 1 :])
        return torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)

    # --- persistence -----------------------------------------------------------------------------

    #: Weights that are the target's own (frozen, rebuilt from it at load): not stored in checkpoints.
    TARGET_TIED: tuple[str, ...] = ()

    def save(self, folder: str | Path, *, dtype: torch.dtype = torch.float16, int8: bool = False) -> None:
        """Write ``config.json`` and ``model.safetensors`` atomically into ``folder``.

        ``int8``: matrices stored as int8 with a float32 scale per row (:func:`pack_int8`; half the bytes of fp16,
        what the shipped drafters use to keep the repository small); loading restores floats, so a drafter runs as
        usual. Drafts only steer what the target verifies: rounding a drafter's weights never changes an output."""
        from safetensors.torch import save_file

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().cpu() for k, v in self.state_dict().items() if k not in self.TARGET_TIED}
        tensors = stored_tensors(state, dtype=dtype, int8=int8)
        # Weights first, config last: a config only ever describes weights already in place.
        with atomic_path(folder / "model.safetensors") as tmp:
            save_file(tensors, str(tmp), metadata={"format": self.FORMAT})
        write_text(folder / "config.json", self.cfg.to_json())

    @classmethod
    def load(
        cls,
        folder: str | Path,
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        target: Any = None,
    ):
        """Load a drafter saved by :meth:`save`; corrupt or mismatched files raise DartspecError. ``target``
        (checked against the drafter) supplies the weights the checkpoint takes from it (:attr:`TARGET_TIED`)."""
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        folder = Path(folder)
        cfg_path, w_path = folder / "config.json", folder / "model.safetensors"
        for p in (cfg_path, w_path):
            if not p.is_file():
                raise DartspecError(f"{p} not found: not a DART drafter checkpoint folder")
        cfg = DartConfig.from_json(cfg_path.read_text(), str(cfg_path), cls.FORMAT)
        # Built on the CPU, randomly initialised (~0.1 s): under torch.device("meta") torch's Python meta kernels import
        # torch._dynamo, ~0.9 s of a command's start on 2 cores.
        model = cls(cfg)
        try:
            state = unpack_int8(load_file(str(w_path)))
        except (SafetensorError, OSError, ValueError) as err:
            raise DartspecError(f"{w_path} is corrupted ({err}); retrain or re-download the drafter") from None
        expected = model.state_dict()
        tied = [k for k in cls.TARGET_TIED if k not in state]
        missing = sorted(set(expected) - set(state) - set(tied))
        unexpected = sorted(set(state) - set(expected))
        wrong = [k for k in expected if k in state and tuple(state[k].shape) != tuple(expected[k].shape)]
        if missing or unexpected or wrong:
            detail = "; ".join(
                s
                for s in (
                    f"missing {missing[:3]}" if missing else "",
                    f"unexpected {unexpected[:3]}" if unexpected else "",
                    f"wrong shapes {wrong[:3]}" if wrong else "",
                )
                if s
            )
            raise DartspecError(f"{w_path} does not match its config.json ({detail})")
        model.load_state_dict(state, strict=False)
        if target is not None:
            model.check_target(target)
        if tied:
            if target is None:
                raise DartspecError(f"{folder} takes {', '.join(tied)} from its target: load it with the target")
            model.tie_to_target(target)
        # load_state_dict copies into the existing float32 parameters: the dtype is set afterwards.
        return model.to(device=device, dtype=dtype)

    def tie_to_target(self, target: Any) -> None:
        """Fill :attr:`TARGET_TIED` weights from ``target`` (networks that have some override it)."""

    def check_target(self, target: Any) -> None:
        """Refuse a drafter trained for another target (vocabulary or shapes differ)."""
        cfg = self.cfg
        if cfg.hidden_size != target.hidden_size or cfg.target_vocab_size != target.vocab_size:
            raise DartspecError(
                f"this drafter was trained for {cfg.target_name or 'another target'} (hidden {cfg.hidden_size}, "
                f"vocab {cfg.target_vocab_size}), not {target.name} (hidden {target.hidden_size}, "
                f"vocab {target.vocab_size})"
            )
        if max(cfg.feature_layers) >= target.num_layers:
            raise DartspecError(
                f"the drafter reads target layers {list(cfg.feature_layers)} but {target.name} has "
                f"{target.num_layers} layers"
            )
        if cfg.target_fingerprint and cfg.target_fingerprint != target_fingerprint(target):
            raise DartspecError(
                f"this drafter was trained for {cfg.target_name or 'another target'}, not {target.name} "
                "(their tokenizers or numbers of layers differ)"
            )


#: Key suffix of an int8-stored matrix's per-row scales in ``model.safetensors``.
SCALE_SUFFIX = ":scale"


def pack_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A matrix as int8 rows and float32 scales (row max / 127): each weight within half a step of its row's grid."""
    w = weight.to(torch.float32)
    scale = (w.abs().amax(dim=1, keepdim=True) / 127).clamp_min(torch.finfo(torch.float32).tiny)
    return torch.round(w / scale).clamp_(-127, 127).to(torch.int8).contiguous(), scale.contiguous()


def stored_tensors(
    state: dict[str, torch.Tensor], *, dtype: torch.dtype = torch.float16, int8: bool = False
) -> dict[str, torch.Tensor]:
    """What ``model.safetensors`` holds for ``state``: floats in ``dtype``, matrices int8 + scales if ``int8``."""
    out = {}
    for k, v in state.items():
        if int8 and v.is_floating_point() and v.dim() == 2:
            out[k], out[k + SCALE_SUFFIX] = pack_int8(v)
        else:
            out[k] = (v.to(dtype) if v.is_floating_point() else v).contiguous()
    return out


def recast_checkpoint(
    src: str | Path,
    dst: str | Path,
    *,
    dtype: torch.dtype = torch.float16,
    int8: bool = False,
    drop: tuple[str, ...] = (),
) -> None:
    """Copy a drafter checkpoint folder (any kind) with its weights stored as :meth:`DartModel.save` would
    (e.g. a training run's fp32 export -> the shipped int8 form), without building the network or its target;
    ``drop``: weights left out (a network's :attr:`~DartModel.TARGET_TIED`, from exports that still held them)."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    with safe_open(str(src / "model.safetensors"), "pt") as f:
        metadata = f.metadata()
    state = {k: v for k, v in unpack_int8(load_file(str(src / "model.safetensors"))).items() if k not in drop}
    tensors = stored_tensors(state, dtype=dtype, int8=int8)
    with atomic_path(dst / "model.safetensors") as tmp:
        save_file(tensors, str(tmp), metadata=metadata)
    write_text(dst / "config.json", (src / "config.json").read_text())


def unpack_int8(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with every int8-stored matrix (a key with a :data:`SCALE_SUFFIX` partner) back in float32."""
    out = {k: v for k, v in state.items() if not k.endswith(SCALE_SUFFIX)}
    for key, scale in state.items():
        if key.endswith(SCALE_SUFFIX):
            name = key[: -len(SCALE_SUFFIX)]
            if name not in out or out[name].dtype != torch.int8 or scale.shape != (out[name].shape[0], 1):
                raise ValueError(f"{key} has no int8 matrix of {scale.shape[0]} rows beside it")
            out[name] = out[name].to(torch.float32) * scale
    return out


def init_head_from_target(model: DartModel, target: Any, draft_ids: torch.Tensor) -> None:
    """Start the draft LM head from the target's head rows for the draft vocabulary (faster training)."""
    with torch.no_grad():
        model.d2t.copy_(draft_ids.to(model.d2t.device))
        model.lm_head.weight.copy_(target.lm_head_weight()[draft_ids.to(target.device)].to(model.lm_head.weight))


def param_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
