"""The VFM trial (``unmask train --objective vfm``; docs/design.md#the-seeds-methods, issue 26): prompt-conditioned
noise in place of the mask embeddings, for decoding a whole answer in one (or a few) forward(s). An experiment that
measured no gain (docs/methods.md), kept apart from the main objectives: :class:`VfmObjective` is its whole
hook-up to the trainer.

Source: variational flow maps ("make some noise", arXiv:2603.07276), as the seed's fork (dLLM-castlehill,
``tasks/train_vfm*.py``) carries it to text: an adapter reads the prompt and outputs, for every generation
position, a mean and a log-variance in the model's input-embedding space; a reparameterised sample replaces the
mask embeddings; the model decodes every position at once. Loss = completion cross-entropy + prompt
cross-entropy + ``beta * KL(q || N(0, I))``, beta annealed from 0. This module is our own code for that recipe.

What is built here, and why:

* **Noise adapter** (:class:`NoiseAdapter`): ``pooled = [h_last ; mean_j h_j]`` (``[B, 2H]``, the parent's final
  hidden state of the prompt's last token and the prompt's mean; float32) -> ``u = W_in pooled`` (``[B, d]``),
  ``a_i = SiLU(u + p_i)`` with a learned per-position vector ``p_i`` (``[G, d]``) -> ``(mu_i, logvar_i) = W_out
  a_i`` (``[B, G, H]`` each). A 2-layer MLP of ``2H*d + G*d + d*2H`` weights (d = 256, H = 576, G = 32 for
  SmolLM2: 0.6 M): small, so the trial measures the *noise*, not a second network. The fork's verdict was no
  quality gain for a large (transformer) adapter; a cheap one is what a 2-core CPU can train in 15 minutes.
* **Where the noise lives**: ``e_i = m + s * z_i`` with ``z_i ~ q_i = N(mu_i, diag exp(logvar_i))``, ``m`` the
  mask embedding the model decodes with (the mask-row adapter's vector) and ``s`` (``[H]``) the per-dimension
  standard deviation of the token-embedding table. The prior ``N(0, I)`` is therefore "the plain mask embedding
  plus token-sized noise", and ``z = 0`` is exactly plain decoding (the "without VFM noise" arm). ``W_out`` starts
  at zero and ``logvar`` at :data:`LOGVAR_INIT`, so training starts from (almost) the plain model.
* **Trainable scope**: only the noise adapter; the parent *and* the mask-row adapter (``--init-adapter``, e.g. the
  shipped default) are frozen. The committed prompt rows run the parent and never see the answer rows
  (prefix-causal), so the prompt cross-entropy has no gradient in this scope: it is a constant and is not
  computed (it matters when the base is trained too, as in the fork's joint LoRA mode).
* **Training rows** (:func:`build_rows`): ``prompt | G answer positions`` in one forward: the prompt committed
  (causal, the parent), the G positions one non-committed attention group (the engine's active block of size G,
  ``unmask.engine.attention``) running the mask-row adapter. Labels are the answer's first G tokens, padded with
  EOS. A row masks all G positions with probability ``full`` (the one-step case), else a fraction
  ``t ~ U(0.25, 1)`` (the later steps of K-step decoding, where revealed tokens are clean). CE is the mean over
  masked positions; the KL ``sum_h KL(q_ih || N(0,1))`` is the mean over the same positions.
* **beta** (:func:`beta_at`): linear from 0 to ``beta`` over the first ``warmup`` fraction of the run (progress =
  the wall-clock budget's fraction under ``--max-minutes``, else step / max_steps), then constant (the fork's
  ``kl_weight`` warm-up).
* **Decoding** (:func:`decode`): an evaluation-only decoder (not the engine): the G positions are one block
  decoded in K steps (K = 1: one step), LLaDA's quota (``ceil(masks left / steps left)`` highest-confidence
  positions per step, greedy), with the noise drawn once per request (``sample``), its mean (``mean``) or none
  (``none``: plain mask embeddings). Wiring per-position input embeddings into the engine's ``MaskEmbedding`` seam
  was not done for a trial that showed no gain (docs/methods.md "VFM trial").
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from unmask.engine.attention import build_attention_mask

from ..common import TrainError, seed_of
from ..losses import LossParts, Rows
from ..objectives.base import Objective

#: initial log-variance of q (sigma = 0.05 token-embedding standard deviations): the start is the plain model
LOGVAR_INIT = -6.0
#: lower bound of the partial mask rate of non-full rows
T_MIN = 0.25
ADAPTER_FILE = "vfm_adapter.safetensors"
CONFIG_FILE = "vfm_adapter.json"
FORMAT = "unmask-vfm-adapter"


class NoiseAdapter(nn.Module):
    """``forward(pooled [B, 2H] float32) -> (mu, logvar)``, each ``[B, G, H]`` float32 (see the module doc).

    Args:
        hidden: the model's hidden size H. gen_len: G, the generation positions it has a vector for.
        width: d, the MLP's inner width. scale: ``[H]`` float32 per-dimension std of the token embeddings
            (stored with the adapter so decoding uses the training scale).

    Raises:
        ValueError: non-positive sizes (names the field).
    """

    def __init__(self, hidden: int, gen_len: int, width: int = 256, scale: torch.Tensor | None = None,
                 seed: int = 0):
        super().__init__()
        for name, v in (("hidden", hidden), ("gen_len", gen_len), ("width", width)):
            if v < 1:
                raise ValueError(f"vfm adapter: {name} must be >= 1, got {v}")
        g = torch.Generator().manual_seed(seed)
        self.hidden, self.gen_len, self.width = int(hidden), int(gen_len), int(width)
        self.inp = nn.Linear(2 * hidden, width)
        with torch.no_grad():
            self.inp.weight.copy_(torch.randn(width, 2 * hidden, generator=g) / math.sqrt(2 * hidden))
            self.inp.bias.zero_()
        self.pos = nn.Parameter(torch.randn(gen_len, width, generator=g) * 0.02)
        self.out = nn.Linear(width, 2 * hidden)
        with torch.no_grad():
            self.out.weight.zero_()
            self.out.bias.zero_()
            self.out.bias[hidden:] = LOGVAR_INIT
        s = torch.ones(hidden) if scale is None else scale.detach().float().reshape(hidden)
        self.register_buffer("scale", s.clone())

    def forward(self, pooled: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a = F.silu(self.inp(pooled.float())[:, None, :] + self.pos[None])
        mu, logvar = self.out(a).chunk(2, dim=-1)
        return mu, logvar.clamp(-12.0, 4.0)


def kl_standard_normal(mu: torch.Tensor, logvar: torch.Tensor) -> torch.Tensor:
    """``KL(N(mu, exp(logvar)) || N(0, 1))`` summed over the last dimension: ``[...]`` float32 from ``[..., H]``
    (``0.5 * sum(exp(logvar) + mu^2 - 1 - logvar)``, the Gaussian VAE term, Kingma & Welling 2014, appendix B)."""
    mu, logvar = mu.float(), logvar.float()
    return 0.5 * (logvar.exp() + mu.square() - 1.0 - logvar).sum(-1)


def beta_at(progress: float, beta: float, warmup: float) -> float:
    """The KL weight at run ``progress`` in [0, 1]: ``beta * min(1, progress / warmup)``; ``warmup = 0`` gives
    ``beta`` from the start. Progress outside [0, 1] is clamped."""
    p = min(max(float(progress), 0.0), 1.0)
    return beta if warmup <= 0 else beta * min(1.0, p / warmup)


def embedding_scale(embed_weight: torch.Tensor) -> torch.Tensor:
    """``[H]`` float32: per-dimension standard deviation of the token-embedding table ``[V, H]``."""
    return embed_weight.detach().float().std(dim=0).clamp_min(1e-6)


# ---------------------------------------------------------------------------------------------------- rows
@dataclass
class VfmRows(Rows):
    """One forward's rows: :class:`~unmask.training.losses.Rows` (``prompt | G positions``, right-padded) and where
    the G generation positions are."""

    gen_start: torch.Tensor  # [B] int64: the prompt lengths
    masked: torch.Tensor  # [B, G] bool: the positions holding noise (the rest hold their label)
    labels: torch.Tensor  # [B, G] int64
    prompt_ids: torch.Tensor  # [B, P]: the prompts alone (for pooling)
    prompt_valid: torch.Tensor  # [B, P] bool

    @property
    def norm(self) -> float:
        """The masked positions (the CE's divisor)."""
        return float(self.masked.sum())


def canvas(prompts: list[list[int]], gen: torch.Tensor, mask_id: int, pad_id: int) -> VfmRows:
    """Rows ``prompt_b | gen[b]`` with the engine's attention (prompt committed and causal, the G positions one
    non-committed group): ``gen`` ``[B, G]`` int64 holds the generation positions' current tokens (``mask_id`` =
    masked). ``labels`` is a copy of ``gen``; callers set it."""
    B, G = gen.shape
    plen = torch.tensor([len(p) for p in prompts], dtype=torch.long)
    P = int(plen.max())
    L = P + G
    ids = torch.full((B, L), pad_id, dtype=torch.long)
    pids = torch.full((B, P), pad_id, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, :len(p)] = torch.tensor(p, dtype=torch.long)
        ids[b, len(p):len(p) + G] = gen[b]
        pids[b, :len(p)] = torch.tensor(p, dtype=torch.long)
    col = torch.arange(L)[None].expand(B, L)
    valid = col < (plen + G)[:, None]
    in_gen = (col >= plen[:, None]) & valid
    grp = torch.where(in_gen, plen[:, None].expand(B, L), col)
    committed = ~in_gen
    attn = build_attention_mask(col, grp, grp, valid, col, grp, committed & valid, valid)
    return VfmRows(ids, col.clone(), attn, valid, plen, gen == mask_id, gen.clone(), pids,
                   torch.arange(P)[None] < plen[:, None])


def build_rows(prompts: list[list[int]], answers: list[list[int]], gen_len: int, mask_id: int, eos_id: int,
               pad_id: int, generator: torch.Generator, full: float = 0.5) -> VfmRows:
    """Training rows: labels = each answer's first ``gen_len`` tokens padded with ``eos_id``; a row masks every
    position with probability ``full``, else ``ceil(t * G)`` random positions, ``t ~ U(T_MIN, 1)`` (draws from
    ``generator``, so a (seed, step) gives the same rows).

    Raises:
        ValueError: ``prompts``/``answers`` of different lengths, an empty prompt or answer.
    """
    if len(prompts) != len(answers):
        raise ValueError(f"vfm rows: {len(prompts)} prompts but {len(answers)} answers")
    G = gen_len
    labels = torch.full((len(prompts), G), eos_id, dtype=torch.long)
    masked = torch.zeros(len(prompts), G, dtype=torch.bool)
    for b, (p, a) in enumerate(zip(prompts, answers)):
        if not p or not a:
            raise ValueError(f"vfm rows: example {b} has an empty {'prompt' if not p else 'answer'}")
        a = a[:G]
        labels[b, :len(a)] = torch.tensor(a, dtype=torch.long)
        u = float(torch.rand((), generator=generator))
        if u < full:
            masked[b] = True
        else:
            t = T_MIN + (1 - T_MIN) * float(torch.rand((), generator=generator))
            k = max(1, math.ceil(t * G))
            masked[b, torch.randperm(G, generator=generator)[:k]] = True
    gen = torch.where(masked, torch.full_like(labels, mask_id), labels)
    rows = canvas(prompts, gen, mask_id, pad_id)
    rows.labels = labels
    return rows


def rows_from_batch(batch, gen_len: int, mask_id: int, eos_id: int, pad_id: int, generator: torch.Generator,
                    full: float = 0.5) -> VfmRows:
    """:func:`build_rows` over a trainer :class:`~unmask.training.data.Batch`: each example's prompt is everything
    before its first answer span, its answer that span (later turns are not used)."""
    prompts, answers = [], []
    for b, spans in enumerate(batch.spans):
        s, e = spans[0]
        ids = batch.input_ids[b].tolist()
        prompts.append(ids[:s])
        answers.append(ids[s:e])
    return build_rows(prompts, answers, gen_len, mask_id, eos_id, pad_id, generator, full)


# ---------------------------------------------------------------------------------------------------- forward
class VfmForward(nn.Module):
    """The trainer's module: ``forward(rows, generator, mode) -> (logits [B, G, V] float32, mu, logvar)``.

    ``logits[b, i]`` predicts generation position i (with the logit shift: the output one position earlier, for
    i = 0 the prompt's last token, the parent's carry). ``mode``: ``sample`` (reparameterised, the training
    path; ``eps`` ``[B, G, H]`` a given standard-normal draw, else one from ``generator``), ``mean`` (z = mu) or
    ``none`` (z = 0: plain mask embeddings; mu/logvar still returned).
    ``tm``: the :class:`~unmask.training.scopes.TrainModel` (``mask_lora`` scope) with ``tm.base.vfm_noise``.
    """

    def __init__(self, tm):
        super().__init__()
        self.lm = tm.model
        self._tm = [tm]

    def forward(self, rows: VfmRows, generator: torch.Generator | None = None, mode: str = "sample",
                eps: torch.Tensor | None = None):
        tm = self._tm[0]
        base = tm.base
        dec = base.get_decoder()
        adapter: NoiseAdapter = base.vfm_noise
        with torch.no_grad():
            pooled = pool_prompt(dec, rows.prompt_ids, rows.prompt_valid)
        mu, logvar = adapter(pooled)
        emb = dec.embed_tokens(rows.input_ids)
        B, L, H = emb.shape
        G = rows.masked.shape[1]
        if mode == "none":
            z = torch.zeros_like(mu)
        elif mode == "mean":
            z = mu
        elif mode == "sample":
            if eps is None:
                eps = torch.randn(mu.shape, generator=generator, dtype=torch.float32)
            z = mu + (0.5 * logvar).exp() * eps.to(mu.device)
        else:
            raise ValueError(f"vfm mode: {mode!r} is not one of sample, mean, none")
        center = dec.embed_tokens.mask_vector if hasattr(dec.embed_tokens, "mask_vector") else \
            dec.embed_tokens.weight[tm.dllm.mask_token_id]
        noise_emb = center.float() + adapter.scale * z  # [B, G, H]
        idx = rows.gen_start[:, None] + torch.arange(G, device=emb.device)[None]  # [B, G]
        gen_emb = emb.gather(1, idx[..., None].expand(B, G, H))
        gen_emb = torch.where(rows.masked[..., None], noise_emb.to(emb.dtype), gen_emb)
        emb = emb.scatter(1, idx[..., None].expand(B, G, H), gen_emb)
        variant = rows.valid & (torch.arange(L, device=emb.device)[None] >= rows.gen_start[:, None])
        state = getattr(tm, "adapter_state", None)
        ctx = state.select(variant) if state is not None else _null()
        with ctx:
            out = dec(inputs_embeds=emb, position_ids=rows.position_ids, attention_mask=rows.attention_mask,
                      use_cache=False)
        src = idx - 1 if tm.dllm.logit_shift else idx
        hidden = out.last_hidden_state.gather(1, src[..., None].expand(B, G, H))
        return base.get_output_embeddings()(hidden).float(), mu, logvar


def _null():
    import contextlib

    return contextlib.nullcontext()


def pool_prompt(decoder, prompt_ids: torch.Tensor, prompt_valid: torch.Tensor) -> torch.Tensor:
    """``[B, 2H]`` float32: the parent's final hidden state at each prompt's last token and the mean over its
    tokens (a causal forward of the right-padded prompts ``[B, P]``; no adapter rows are selected)."""
    out = decoder(input_ids=prompt_ids, attention_mask=prompt_valid.long(), use_cache=False)
    h = out.last_hidden_state.float()
    last = prompt_valid.long().sum(1) - 1
    h_last = h[torch.arange(h.shape[0], device=h.device), last]
    w = prompt_valid.float()[..., None]
    return torch.cat([h_last, (h * w).sum(1) / w.sum(1)], dim=-1)


def vfm_loss(module, rows: VfmRows, generator: torch.Generator, beta: float) -> LossParts:
    """CE over the masked generation positions (mean) ``+ beta * mean KL`` over the same positions.
    ``LossParts.kl`` carries the un-weighted mean KL (nats per position)."""
    logits, mu, logvar = module(rows, generator)
    m = rows.masked
    ce_all = F.cross_entropy(logits[m], rows.labels[m], reduction="none")
    kl = kl_standard_normal(mu, logvar)[m]
    ce, klm = ce_all.mean(), kl.mean()
    loss = ce + beta * klm
    correct = int((logits[m].argmax(-1) == rows.labels[m]).sum())
    return LossParts(loss=loss, ce=float(ce.detach()), kl=float(klm.detach()), n_scored=int(m.sum()),
                     n_correct=correct)


# ---------------------------------------------------------------------------------------------------- setup, files
def attach(tm, gen_len: int, width: int, seed: int = 0) -> NoiseAdapter:
    """Freeze every parameter of ``tm.base`` (parent and mask-row adapter) and attach a fresh
    :class:`NoiseAdapter` as ``tm.base.vfm_noise`` (trainable; saved by ``trainable_state``)."""
    base = tm.base
    for p in base.parameters():
        p.requires_grad_(False)
    emb = base.get_input_embeddings()
    weight = emb.weight
    ad = NoiseAdapter(base.config.hidden_size, gen_len, width, scale=embedding_scale(weight), seed=seed)
    base.vfm_noise = ad.to(weight.device)
    return ad


def adapter_files(adapter: NoiseAdapter, training: dict | None = None) -> dict[str, bytes]:
    """``{ADAPTER_FILE: safetensors bytes, CONFIG_FILE: json bytes}`` of ``adapter`` (float32 tensors:
    ``inp.weight [d, 2H]``, ``inp.bias [d]``, ``pos [G, d]``, ``out.weight [2H, d]``, ``out.bias [2H]``,
    ``scale [H]``)."""
    from safetensors.torch import save

    tensors = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in adapter.state_dict().items()}
    cfg = {"format": FORMAT, "hidden": adapter.hidden, "gen_len": adapter.gen_len, "width": adapter.width,
           "source": "arXiv:2603.07276 (variational flow maps), docs/design.md#the-seeds-methods",
           "training": training or {}}
    return {ADAPTER_FILE: save(tensors), CONFIG_FILE: (json.dumps(cfg, indent=2) + "\n").encode()}


def load_adapter(path) -> NoiseAdapter:
    """Read :func:`adapter_files`' files from the directory ``path``.

    Raises:
        ValueError: a missing file, another format, or tensors that do not match the config (names the file).
    """
    from pathlib import Path

    from safetensors.torch import load_file

    d = Path(path)
    cfg_path, st_path = d / CONFIG_FILE, d / ADAPTER_FILE
    for f in (cfg_path, st_path):
        if not f.is_file():
            raise ValueError(f"vfm adapter: {f} is missing")
    cfg = json.loads(cfg_path.read_text())
    if cfg.get("format") != FORMAT:
        raise ValueError(f"vfm adapter: {cfg_path}: format {cfg.get('format')!r} is not {FORMAT!r}")
    ad = NoiseAdapter(cfg["hidden"], cfg["gen_len"], cfg["width"])
    try:
        ad.load_state_dict(load_file(str(st_path)))
    except RuntimeError as exc:
        raise ValueError(f"vfm adapter: {st_path}: {exc}") from exc
    return ad


# ---------------------------------------------------------------------------------------------------- decoding
@torch.no_grad()
def decode(module: VfmForward, prompts: list[list[int]], gen_len: int, steps: int, mode: str, mask_id: int,
           pad_id: int, eos_ids: set[int], seed: int = 0) -> list[dict]:
    """Greedy evaluation-only decoding of ``prompts`` (token ids) into ``gen_len`` positions in ``steps`` forwards
    (one block; quota ``ceil(masks left / steps left)`` highest-probability positions per step, LLaDA's
    low-confidence remasking). ``mode``: ``sample`` (one draw per prompt, seeded by ``seed``), ``mean``, ``none``.
    A row stops once an EOS is revealed with every position before it revealed (the engine's finish rule).

    Returns per prompt ``{"ids": [..] up to and including the first EOS, "nfe": forwards}``.

    Raises:
        ValueError: ``steps`` not in ``1..gen_len``, or ``gen_len`` above the adapter's.
    """
    if not 1 <= steps <= gen_len:
        raise ValueError(f"vfm decode: steps must be in 1..{gen_len}, got {steps}")
    if gen_len > module._tm[0].base.vfm_noise.gen_len:
        raise ValueError(f"vfm decode: gen_len {gen_len} exceeds the adapter's {module._tm[0].base.vfm_noise.gen_len}")
    B = len(prompts)
    gen = torch.full((B, gen_len), mask_id, dtype=torch.long)
    nfe = [0] * B
    done = [False] * B
    g = torch.Generator().manual_seed(seed)
    eps = None
    for step in range(steps):
        live = [b for b in range(B) if not done[b]]
        if not live:
            break
        rows = canvas([prompts[b] for b in live], gen[live], mask_id, pad_id)
        dev = next(module.parameters()).device
        rows = rows.to(dev)
        if mode == "sample" and eps is None:  # one draw per prompt, kept across the steps
            eps = torch.randn(B, gen_len, module._tm[0].base.vfm_noise.hidden, generator=g)
        logits, _, _ = module(rows, None, mode, eps=eps[live] if eps is not None else None)
        probs = logits.softmax(-1)
        conf, cand = probs.max(-1)  # [b, G]
        for j, b in enumerate(live):
            m = gen[b] == mask_id
            left = int(m.sum())
            k = math.ceil(left / (steps - step))
            c = torch.where(m, conf[j].cpu(), torch.full_like(conf[j].cpu(), -1.0))
            pick = c.topk(k).indices
            gen[b, pick] = cand[j].cpu()[pick]
            nfe[b] += 1
            for t in gen[b].tolist():
                if t == mask_id or t in eos_ids:
                    done[b] = done[b] or t in eos_ids
                    break
            done[b] = done[b] or not bool((gen[b] == mask_id).any())
    out = []
    for b in range(B):
        ids = []
        for t in gen[b].tolist():
            ids.append(t)
            if t in eos_ids:
                break
        out.append({"ids": ids, "nfe": nfe[b]})
    return out


# ---------------------------------------------------------------------------------------------------- the objective
class VfmObjective(Objective):
    """``--objective vfm``: only the noise adapter trains; the parent and the mask-row adapter (``--init-adapter``)
    are frozen, so a resumed run reads the latter again."""

    name = "vfm"
    mask_lora = True
    frozen_init_adapter = True
    KEYS = ["vfm_gen_len", "vfm_beta", "vfm_beta_warmup", "vfm_width", "vfm_full", "init_adapter"]

    @classmethod
    def check(cls, cfg) -> None:
        if cfg.trainable != "mask_lora":
            raise TrainError("--objective vfm: needs --trainable mask_lora (the parent and the mask-row adapter are "
                             "frozen; only the noise adapter trains)")
        if cfg.eval_every or cfg.teacher_kl > 0 or cfg.certainty > 0 or cfg.complementary or \
                cfg.align_weight > 0 or cfg.fsdp:
            raise TrainError("--objective vfm: --eval-every, --teacher-kl, --certainty, --complementary, "
                             "--align-weight and --fsdp do not apply")
        for name in ("vfm_gen_len", "vfm_width"):
            if getattr(cfg, name) < 1:
                raise TrainError(f"--{name.replace('_', '-')}: must be >= 1, got {getattr(cfg, name)}")
        if not (math.isfinite(cfg.vfm_beta) and cfg.vfm_beta >= 0):
            raise TrainError(f"--vfm-beta: must be a finite number >= 0, got {cfg.vfm_beta}")
        for name in ("vfm_beta_warmup", "vfm_full"):
            if not 0 <= getattr(cfg, name) <= 1:
                raise TrainError(f"--{name.replace('_', '-')}: must be in [0, 1], got {getattr(cfg, name)}")

    def resume_keys(self) -> list[str]:
        return list(self.KEYS)

    def attach(self, run) -> None:
        attach(run.tm, self.cfg.vfm_gen_len, self.cfg.vfm_width, seed=seed_of(self.cfg.seed, 5))

    def forward_module(self, run) -> nn.Module:
        return VfmForward(run.tm)

    def loss(self, run, module, batch, generator, fixed_t=None):
        cfg, dllm = self.cfg, run.tm.dllm
        rows = rows_from_batch(batch, cfg.vfm_gen_len, dllm.mask_token_id, dllm.eos_token_ids[0], run.pad_id,
                               generator, cfg.vfm_full).to(run.acc.device)
        with run.acc.autocast():
            parts = vfm_loss(module, rows, generator, beta_at(run.progress(), cfg.vfm_beta, cfg.vfm_beta_warmup))
        return parts, rows

    def adapter_files(self, run) -> dict[str, bytes]:
        """The noise adapter beside the (frozen) mask-row adapter."""
        return adapter_files(run.tm.base.vfm_noise, {"step": run.step, "data": str(self.cfg.data),
                                                     "init_adapter": self.cfg.init_adapter})
