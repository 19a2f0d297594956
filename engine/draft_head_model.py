"""The draft head's weights and files: :class:`DraftHeadConfig`, :class:`DraftHead` (one Llama-style decoder layer
over ``fc([h_{t-1}; E(x_t)])`` rows, EAGLE: Li et al. 2024, arXiv:2401.15077), its atomic save/load, and the
attention mask of its forwards (:func:`head_rows_mask`).

What the rows mean and how drafting uses them: :mod:`unmask.engine.draft_head` (docs/design.md section 13).
Checkpoint: ``dllm.draft_head`` names a directory with ``config.json`` (:class:`DraftHeadConfig`) and
``model.safetensors`` (the head's weights and ``draft_vocab``).
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .config import CheckpointError, check_int, dataclass_from_dict, read_json_file

HEAD_DIR = "draft_head"  # where unmask train-head and unmask export place a checkpoint's head (dllm.draft_head)
HEAD_CONFIG = "config.json"
HEAD_WEIGHTS = "model.safetensors"


@dataclass
class DraftHeadConfig:
    """Shape of a :class:`DraftHead` (the verifier's sizes; one Llama-style decoder layer by default).

    Attributes:
        hidden_size: the verifier's hidden size ``H``.
        num_heads, num_kv_heads, head_dim: attention shape (grouped-query attention when they differ).
        intermediate_size: SwiGLU width.
        num_layers: decoder layers of the head.
        rms_norm_eps, rope_theta: as the verifier's.
        window: context rows per forward (the last ``window`` final positions).
        draft_vocab_size: ``K``, the number of token ids the head can draft.
        mask_token_id: the verifier checkpoint's mask token (input of undecided draft rows).
        max_drafts: the longest draft block the head was trained for (``k``; requests may draft fewer).
        reveal_threshold: drafting reveals, besides the leftmost undecided draft, the drafts right after it while
            their head confidence is at least this (1.0 = one draft per head forward, left to right; lower = fewer head forwards).
    """

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    num_layers: int = 1
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    window: int = 16
    draft_vocab_size: int = 8192
    mask_token_id: int = 0
    max_drafts: int = 3
    reveal_threshold: float = 1.0

    def validate(self, where: str) -> None:
        """Raise :class:`CheckpointError` naming ``where`` and the field when a value is out of range."""
        for name in ("hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size", "num_layers",
                     "window", "draft_vocab_size", "max_drafts"):
            check_int(where, name, getattr(self, name), 1)
        if self.num_heads % self.num_kv_heads:
            raise CheckpointError(f"{where}.num_kv_heads: {self.num_kv_heads} does not divide num_heads "
                                  f"{self.num_heads}")
        t = self.reveal_threshold
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0.0 <= t <= 1.0:
            raise CheckpointError(f"{where}.reveal_threshold: must be a number in [0, 1], got {t!r}")
        check_int(where, "mask_token_id", self.mask_token_id, 0)

    @classmethod
    def from_verifier(cls, hf_config, mask_token_id: int, **overrides) -> "DraftHeadConfig":
        """Sizes read from a Llama-style transformers config (``hidden_size``, ``num_attention_heads``, ...)."""
        heads = int(hf_config.num_attention_heads)
        kv = int(getattr(hf_config, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads)
        base = dict(hidden_size=int(hf_config.hidden_size), num_heads=heads, num_kv_heads=kv, head_dim=head_dim,
                    intermediate_size=int(hf_config.intermediate_size),
                    rms_norm_eps=float(getattr(hf_config, "rms_norm_eps", 1e-5)),
                    rope_theta=float(getattr(hf_config, "rope_theta", 10000.0)), mask_token_id=int(mask_token_id))
        base.update(overrides)
        return cls(**base)


class _RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        var = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(var + self.eps)).to(x.dtype) * self.weight


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class _HeadLayer(nn.Module):
    """One pre-norm Llama decoder layer (RoPE attention with grouped-query heads, SwiGLU MLP)."""

    def __init__(self, cfg: DraftHeadConfig):
        super().__init__()
        H, nh, nkv, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.cfg = cfg
        self.input_layernorm = _RMSNorm(H, cfg.rms_norm_eps)
        self.q_proj = nn.Linear(H, nh * hd, bias=False)
        self.k_proj = nn.Linear(H, nkv * hd, bias=False)
        self.v_proj = nn.Linear(H, nkv * hd, bias=False)
        self.o_proj = nn.Linear(nh * hd, H, bias=False)
        self.post_attention_layernorm = _RMSNorm(H, cfg.rms_norm_eps)
        self.gate_proj = nn.Linear(H, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(H, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, H, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        B, R, _ = x.shape
        c = self.cfg
        h = self.input_layernorm(x)
        q = self.q_proj(h).view(B, R, c.num_heads, c.head_dim).transpose(1, 2)
        k = self.k_proj(h).view(B, R, c.num_kv_heads, c.head_dim).transpose(1, 2)
        v = self.v_proj(h).view(B, R, c.num_kv_heads, c.head_dim).transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        rep = c.num_heads // c.num_kv_heads
        if rep > 1:
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        att = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None])
        x = x + self.o_proj(att.transpose(1, 2).reshape(B, R, -1))
        h = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class DraftHead(nn.Module):
    """The head's weights: ``fc`` (``2H -> H``), ``num_layers`` decoder layers, a final RMSNorm, and the buffer
    ``draft_vocab`` (``[K]`` int64 token ids). The token embedding and the LM head rows are the verifier's
    (passed to :meth:`forward` / :meth:`logits`, never trained).

    Args:
        cfg: the head's shape.
        draft_vocab: ``[K]`` int64 ids (``K = cfg.draft_vocab_size``, distinct).

    Raises:
        ValueError: ``draft_vocab`` does not hold ``K`` distinct ids.
    """

    def __init__(self, cfg: DraftHeadConfig, draft_vocab: torch.Tensor):
        super().__init__()
        cfg.validate("draft head config")
        if draft_vocab.dim() != 1 or draft_vocab.numel() != cfg.draft_vocab_size or \
                torch.unique(draft_vocab).numel() != draft_vocab.numel():
            raise ValueError(f"draft_vocab: expected {cfg.draft_vocab_size} distinct ids, got shape "
                             f"{tuple(draft_vocab.shape)}")
        self.cfg = cfg
        H = cfg.hidden_size
        self.fc = nn.Linear(2 * H, H, bias=True)
        self.layers = nn.ModuleList(_HeadLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = _RMSNorm(H, cfg.rms_norm_eps)
        self.register_buffer("draft_vocab", draft_vocab.to(torch.long).clone())

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        hd = self.cfg.head_dim
        inv = 1.0 / (self.cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float32,
                                                          device=positions.device) / hd))
        ang = positions.to(torch.float32)[..., None] * inv  # [B, R, hd/2]
        ang = torch.cat((ang, ang), dim=-1)[:, None]       # [B, 1, R, hd]
        return ang.cos().to(dtype), ang.sin().to(dtype)

    def forward(self, features: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
                embedding: torch.Tensor) -> torch.Tensor:
        """Head hidden states (after the final norm).

        Args:
            features: ``[B, R, H]`` float verifier hidden states of the previous position (zeros on draft rows).
            tokens: ``[B, R]`` int64 token ids of the rows (mask token on undecided draft rows).
            positions: ``[B, R]`` int64 canvas positions (RoPE).
            mask: ``[B, R, R]`` bool, True where a row may attend to a key row (every row must see itself).
            embedding: ``[V, H]`` the verifier's token-embedding matrix.

        Returns:
            ``[B, R, H]`` hidden states in ``features``' dtype.
        """
        emb = F.embedding(tokens, embedding).to(features.dtype)
        x = self.fc(torch.cat((features, emb), dim=-1))
        cos, sin = self._rope(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, mask)
        return self.norm(x)

    def logits(self, hidden: torch.Tensor, lm_rows: torch.Tensor) -> torch.Tensor:
        """``[..., K]`` float32 logits over ``draft_vocab`` from ``[..., H]`` hidden states; ``lm_rows`` = ``[K, H]``
        the verifier's LM-head rows of ``draft_vocab``."""
        return (hidden @ lm_rows.to(hidden.dtype).t()).float()

    def init_from_verifier(self, layer_state: dict[str, torch.Tensor], final_norm: torch.Tensor | None) -> None:
        """Start from the verifier's last decoder layer (``layer_state``: its ``state_dict`` with the usual Llama
        names ``self_attn.q_proj.weight``, ``mlp.gate_proj.weight``, ``input_layernorm.weight``, ...), the final norm
        weight, and ``fc`` = ``[I | I]`` (feature plus token embedding). Missing or mis-shaped entries keep the
        random initialisation."""
        names = {"q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj", "v_proj": "self_attn.v_proj",
                 "o_proj": "self_attn.o_proj", "gate_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj",
                 "down_proj": "mlp.down_proj", "input_layernorm": "input_layernorm",
                 "post_attention_layernorm": "post_attention_layernorm"}
        with torch.no_grad():
            for layer in self.layers:
                for mine, theirs in names.items():
                    src = layer_state.get(f"{theirs}.weight")
                    dst = getattr(layer, mine).weight
                    if src is not None and tuple(src.shape) == tuple(dst.shape):
                        dst.copy_(src.to(dst.dtype))
            if final_norm is not None and final_norm.shape == self.norm.weight.shape:
                self.norm.weight.copy_(final_norm.to(self.norm.weight.dtype))
            H = self.cfg.hidden_size
            eye = torch.eye(H, dtype=self.fc.weight.dtype)
            self.fc.weight.copy_(torch.cat((eye, eye), dim=1))
            self.fc.bias.zero_()

    # ------------------------------------------------------------------ files
    def save(self, directory: str | Path) -> Path:
        """Write ``config.json`` and ``model.safetensors`` to ``directory`` atomically (a temporary sibling
        directory renamed over it; an interrupted save leaves the previous head intact). Returns the path."""
        from safetensors.torch import save_file

        directory = Path(directory)
        directory.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
        try:
            state = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
            save_file(state, str(tmp / HEAD_WEIGHTS))
            (tmp / HEAD_CONFIG).write_text(json.dumps(dataclasses.asdict(self.cfg), indent=2) + "\n")
            for f in (tmp / HEAD_WEIGHTS, tmp / HEAD_CONFIG):
                with open(f, "rb") as fh:
                    os.fsync(fh.fileno())
            os.chmod(tmp, 0o755)  # mkdtemp makes it private; the rest of a checkpoint is world-readable
            old = directory.with_name(f".{directory.name}.old")
            if old.exists():
                shutil.rmtree(old)
            if directory.exists():
                directory.rename(old)
            tmp.rename(directory)
            if old.exists():
                shutil.rmtree(old)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            old = directory.with_name(f".{directory.name}.old")
            if old.exists() and not directory.exists():  # interrupted between the two renames: put it back
                old.rename(directory)
            raise
        return directory

    @classmethod
    def load(cls, directory: str | Path, device: torch.device | str = "cpu") -> "DraftHead":
        """Read a head written by :meth:`save`.

        Raises:
            CheckpointError: a missing file, invalid JSON (file:line:col) or not an object, an unknown or invalid
                config field, or weights that do not match the config (names the file).
        """
        from safetensors.torch import load_file

        directory = Path(directory)
        cfg_file, w_file = directory / HEAD_CONFIG, directory / HEAD_WEIGHTS
        for f in (cfg_file, w_file):
            if not f.is_file():
                raise CheckpointError(f"{f}: missing (a draft head directory holds {HEAD_CONFIG} and {HEAD_WEIGHTS})")
        cfg = dataclass_from_dict(DraftHeadConfig, read_json_file(cfg_file), str(cfg_file))
        cfg.validate(str(cfg_file))
        try:
            state = load_file(str(w_file))
        except Exception as exc:  # safetensors raises its own error types for truncated/corrupt files
            raise CheckpointError(f"{w_file}: unreadable ({exc})") from exc
        vocab = state.get("draft_vocab")
        if vocab is None:
            raise CheckpointError(f"{w_file}: no draft_vocab tensor")
        try:
            head = cls(cfg, vocab)
            head.load_state_dict(state)
        except (ValueError, RuntimeError) as exc:
            raise CheckpointError(f"{w_file}: does not match {cfg_file} ({exc})") from exc
        return head.to(device).eval()


def head_rows_mask(n_ctx: torch.Tensor, n_draft: torch.Tensor, rows: int, window: int) -> torch.Tensor:
    """The ``[B, rows, rows]`` bool attention mask of head forwards whose rows are ``n_ctx[b]`` context rows
    followed by ``n_draft[b]`` draft rows (then padding, which sees only itself). Context row ``i`` sees context
    rows ``i - window + 1 .. i``; draft rows see the last ``window`` context rows and every draft row.
    ``n_ctx``/``n_draft``: ``[B]`` int64."""
    B = n_ctx.numel()
    dev = n_ctx.device
    i = torch.arange(rows, device=dev)
    q, k = i[None, :, None], i[None, None, :]
    nc, nd = n_ctx[:, None, None], n_draft[:, None, None]
    q_ctx, k_ctx = q < nc, k < nc
    q_draft = (q >= nc) & (q < nc + nd)
    k_draft = (k >= nc) & (k < nc + nd)
    ctx_sees = q_ctx & k_ctx & (k <= q) & (k > q - window)
    draft_sees = q_draft & ((k_ctx & (k >= nc - window)) | k_draft)
    return (ctx_sees | draft_sees | (q == k)).expand(B, rows, rows)
