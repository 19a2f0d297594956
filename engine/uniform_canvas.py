"""The uniform-canvas sampler: DiffusionGemma's decoding (docs/design.md#decoding, "Uniform canvas"), the rule of
transformers 5.25's ``DiffusionGemmaForBlockDiffusion.generate()`` run as an engine strategy (continuous batching,
a :class:`StepEvent` per step).

Per canvas of ``C`` = ``canvas_length`` generated tokens, one after another:

* the encoder reads the tokens not yet in the choice's KV cache once (the prompt, then each finished canvas), with
  transformers' own masks and positions (``_prepare_encoder_inputs``); the cache is the choice's own
  ``DynamicCache``;
* the canvas starts as ``C`` uniform draws over the vocabulary; each of at most ``max_denoising_steps`` = N steps
  (``cur_step`` N..1) forwards the decoder over the canvas (bidirectional self-attention, read-only attention to
  the encoder's cache, the previous step's tempered logits as self-conditioning, none at the first), tempers its
  logits by the linear schedule ``t_min + (t_max - t_min) * cur_step / N``, samples a denoiser canvas from them,
  accepts the lowest-entropy tokens whose summed entropy less the largest is within ``entropy_bound``, re-noises
  every other position uniformly, and stops early when the argmax canvas has not changed for
  ``stability_threshold`` steps and the mean token entropy is below ``confidence_threshold``;
* the canvas's final tokens are its last argmax canvas; the stop rules (EOS, stop strings, ``max_tokens``) then see
  them.

Randomness (docs/design.md#decoding, "Uniform canvas"): each choice draws from its own ``torch.Generator`` seeded
with its seed, the shapes and order ``generate()`` draws at batch 1 (``randint`` ``[1, C]`` per canvas, then per
step ``multinomial`` over ``C`` rows and ``randint`` ``[1, C]``), so a choice alone = in any batch = ``generate()``
at batch 1 after ``torch.manual_seed(seed)``.

Streaming: a canvas's tokens are provisional until it ends (``StepEvent.final`` = its first generated position; the
events' ``canvas`` shows its argmax canvas there, ``revealed`` the positions whose argmax token changed this step,
with its tempered probability), earlier canvases are final; the step that ends a canvas reveals all of it, final.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from .outputs import StepEvent, revealed_token
from .request import Request

__all__ = ["UniformCanvasSequence", "step_uniform"]


class UniformCanvasSequence(Request):
    """A choice decoded by the uniform-canvas sampler (module docstring). Same arguments as
    :class:`~unmask.engine.request.Request`; the plan's ``uniform`` holds the options.

    Attributes:
        own_forward: the denoiser steps it through :func:`step_uniform` (not the one-forward seam).
        generator: the choice's random stream (seeded with its seed). kv: its encoder ``DynamicCache``;
            kv_version: a new object at each encode (what :class:`_StackedCache` checks); stacked: the batch's
            stacked cache it last stepped in.
        current / argmax: ``[1, C]`` int64 canvas and argmax canvas of the active canvas (argmax_ids: the latter
            as host ids); sc: the last step's tempered logits ``[1, C, V]`` (None before the first step of a canvas).
    """

    own_forward = True

    def __init__(self, *args, **kwargs):
        self.kv = None
        self.kv_version = None  # a new object after every encode: what a stacked cache of the batch was built from
        self.stacked = None  # the batch's _StackedCache this choice was last stepped in
        self.encoded = 0  # generated canvases the encoder has read
        self.current = self.argmax = self.sc = None
        self.argmax_ids: list[int] = []  # the argmax canvas as host ids
        self.cur_step = 0  # steps left in the active canvas (generate()'s cur_step); 0 = not started
        self.stopper_state = None
        super().__init__(*args, **kwargs)
        self.options = self.plan.uniform
        self.generator = torch.Generator().manual_seed(int(self.plan.seed))

    # the encoder runs the whole prompt in the first step: no chunked prefill, no lanes' caches
    def pending_prompt_rows(self) -> int:
        return 0

    def prefill_inputs(self, budget):
        return None

    @property
    def canvas_start(self) -> int:
        """The active canvas's first canvas position."""
        return self.prompt_len + self.block_idx * self.block_size

    @property
    def final_end(self) -> int:
        """Where the provisional region starts: the active canvas while it is refined."""
        return self.canvas_start if not self.finished and self.cur_step else self.length

    def stop_scan_end(self) -> int:
        return min(self.final_end, self.prompt_len + self.max_tokens)

    def canvas_view(self) -> list[int | None]:
        """Final tokens, then the active canvas's argmax canvas (provisional), then ``None``."""
        view = super().canvas_view()
        if self.argmax is not None and self.cur_step and not self.finished:
            a = self.canvas_start - self.prompt_len
            for i, t in enumerate(self.argmax[0].tolist()[: max(0, self.max_tokens - a)]):
                view[a + i] = t
        return view

    def event(self, block: int, step: int, revealed) -> StepEvent:
        ev = super().event(block, step, revealed)
        if self.finished or not self.cur_step:
            return ev
        return replace(ev, final=max(0, self.canvas_start - self.prompt_len))

    def cache_bytes(self) -> int:
        if self.kv is None:
            return 0
        return sum(t.numel() * t.element_size() for layer in self.kv.layers
                   for t in (getattr(layer, "keys", None), getattr(layer, "values", None)) if torch.is_tensor(t))

    def release(self) -> None:
        super().release()
        self.kv = self.sc = self.stacked = None

    # ------------------------------------------------------------------ one canvas
    def encode(self, model, store=None) -> None:
        """Read the tokens not yet in the cache (the prompt, or the last finished canvas) with the encoder, and
        draw the new canvas (``generate()``'s steps 1.a and 1.b at batch 1). ``store``: an
        :class:`~unmask.engine.encoder_prefix.EncoderPrefixStore` to start the prompt from and to keep the cache in."""
        from transformers import DynamicCache

        P, C, dev = self.prompt_len, self.block_size, model.device
        if self.kv is None:
            done, self.kv = store.lookup(self.prompt_ids, self.cache_salt) if store is not None else (0, None)
            self.cached_tokens = done
            if self.kv is None:
                self.kv = DynamicCache(config=model.model.config.get_text_config(decoder=True))
            # the prompt (or what a stored prefix leaves of it) in one prefill, as generate() reads a prompt
            ids = torch.tensor([self.prompt_ids[done:]], dtype=torch.long, device=dev)
            first, cur_len = True, P
        else:
            start = P + (self.encoded - 1) * C
            ids = self.canvas[start: start + C][None].to(dev)
            first, cur_len = False, start + C
        if ids.shape[1]:
            positions = torch.arange(cur_len - ids.shape[1], cur_len, dtype=torch.int32, device=dev)[None]
            mask = torch.ones((1, cur_len), dtype=torch.bool, device=dev)
            net = model.model
            ids, masks = net._prepare_encoder_inputs(input_ids=ids, attention_mask=mask,
                                                     encoder_position_ids=positions, cache=self.kv,
                                                     is_prefill=first, canvas_length=C, batch_size=1)
            net.model.encoder(input_ids=ids, attention_mask=masks, cache=self.kv, position_ids=positions)
            if store is not None:
                store.store(self.canvas[:cur_len].tolist(), self.kv, self.cache_salt)
        self.kv_version = object()
        V = model.model.config.text_config.vocab_size
        self.current = torch.randint(0, V, (1, C), generator=self.generator).to(dev)
        self.argmax, self.sc, self.encoded = self.current, None, self.encoded + 1
        self.cur_step = self.options.max_denoising_steps
        self.stopper_state = None

    def positions(self, device) -> torch.Tensor:
        """``[1, C]`` int32 decoder positions of the active canvas."""
        s = self.canvas_start
        return torch.arange(s, s + self.block_size, dtype=torch.int32, device=device)[None]

    def temper(self, raw: torch.Tensor) -> torch.Tensor:
        """``[1, C, V]`` logits at this step's temperature, as ``LinearTemperatureScheduleLogitsProcessor`` computes
        it (a float32 0-d tensor from the int32 ``cur_step``)."""
        from transformers.models.diffusion_gemma.generation_diffusion_gemma import (
            LinearTemperatureScheduleLogitsProcessor)

        o = self.options
        cur = torch.tensor(self.cur_step, device=raw.device, dtype=torch.int32)
        return LinearTemperatureScheduleLogitsProcessor(o.t_min, o.t_max, o.max_denoising_steps)(None, raw,
                                                                                                   cur_step=cur)

    def consume_logits(self, processed: torch.Tensor, probs: torch.Tensor, argmax: torch.Tensor,
                       entropy: torch.Tensor, accept: torch.Tensor, shown: tuple[list, list, list],
                       embed_dtype: torch.dtype) -> StepEvent:
        """One denoising step's sampling (``_denoising_step``, steps 1.c.ii-v, at batch 1) from this choice's
        tempered logits ``[1, C, V]`` and what :func:`step_uniform` computed from them for the whole batch (this
        choice's rows: their softmax, argmax ``[1, C]``, token entropies ``[1, C]``, entropy-bound acceptance
        ``[1, C]``, and ``shown``: the argmax ids, their probabilities and log-probabilities as host lists of ``C``):
        the draws from the choice's generator, the re-noising, the stopping rule."""
        o = self.options
        V = processed.shape[-1]
        g = self.generator
        denoised = torch.multinomial(probs.view(-1, V).cpu(), num_samples=1, generator=g).view(1, -1)
        accepted = torch.where(accept, denoised.to(processed.device), self.current)
        noise = torch.randint(0, V, (1, self.block_size), generator=g).to(processed.device)
        self.current = torch.where(~accept, noise, accepted)
        stop = self._stable_and_confident(argmax, entropy)
        ids, conf, logconf = shown
        before = self.argmax_ids if self.cur_step != o.max_denoising_steps else None
        self.argmax, self.argmax_ids, self.sc = argmax, ids, processed.to(embed_dtype)
        self.cur_step -= 1
        self.step += 1
        self.step_in_block += 1
        block, step = self.block_idx, self.step - 1
        rel = self.canvas_start - self.prompt_len
        if stop or not self.cur_step:
            self._end_canvas()
            before = None  # the whole canvas, final now
        revealed = [revealed_token(rel + i, t, conf[i], logconf[i])
                    for i, t in enumerate(ids[: max(0, self.max_tokens - rel)]) if before is None or t != before[i]]
        return self.event(block, step, revealed)

    def _stable_and_confident(self, argmax: torch.Tensor, entropy: torch.Tensor) -> bool:
        """``StableAndConfidentStoppingCriteria`` at batch 1: the argmax canvas equals each of the last
        ``stability_threshold`` ones (their history kept per canvas) and the mean token entropy is below
        ``confidence_threshold``."""
        o = self.options
        if o.stability_threshold == 0:
            stable = True
        else:
            if self.stopper_state is None:
                self.stopper_state = torch.full((o.stability_threshold, *argmax.shape), -1, dtype=argmax.dtype,
                                                device=argmax.device)
            stable = bool((self.stopper_state == argmax[None]).all())
            self.stopper_state = torch.roll(self.stopper_state, shifts=-1, dims=0)
            self.stopper_state[-1] = argmax
        return stable and bool(torch.mean(entropy, dim=-1)[0] < o.confidence_threshold)

    def _end_canvas(self) -> None:
        """The active canvas is final: its argmax canvas goes into the canvas, the stop rules see it. Near the
        context's end the layout's last block is shorter than ``C`` (``build_layout`` clamps it to the context):
        the canvas is sampled whole, as ``generate()`` samples it, and only the positions that fit are kept."""
        C, s = self.block_size, self.canvas_start
        fit = max(0, min(C, self.canvas.shape[0] - s))
        self.canvas[s: s + fit] = self.argmax[0, :fit].cpu()
        self.cur_step = 0
        self.blocks_done_steps.append(self.step_in_block)
        self.step_in_block = self.step_in_window = 0
        self.win_idx += 1
        self.block_idx += 1
        self._check_finished()


def entropy_bound_mask(entropy: torch.Tensor, bound: float | torch.Tensor) -> torch.Tensor:
    """``[B, C]`` bool: the positions ``EntropyBoundSampler.accept_canvas`` accepts (the lowest entropies whose sum
    less their largest is within ``bound``, a number or ``[B, 1]`` per row; arXiv:2505.24857), from ``[B, C]``
    token entropies."""
    ordered, order = torch.sort(entropy, dim=-1, descending=False)
    chosen = torch.cumsum(ordered, dim=-1) - ordered <= bound
    return torch.scatter(torch.zeros_like(chosen), -1, order, chosen)


class _Layer:
    """One layer's padded keys and values for a batched decoder step (what the decoder's attention reads)."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor):
        self.keys, self.values = keys, values


class _StackedCache:
    """Several choices' encoder caches, left-padded per layer to the longest (the decoder only reads
    ``layers[i].keys/values`` and ``is_compileable``), with their attention masks (:func:`_masks`). Built once per
    batch composition: ``versions`` are the choices' ``kv_version`` objects in batch order, and a choice's cache
    changes only when it encodes (which gives it a new one), so the same versions mean the same padded tensors."""

    is_compileable = False

    def __init__(self, seqs: list[UniformCanvasSequence], layer_types: list[str], device):
        caches = [s.kv for s in seqs]
        self.versions = [s.kv_version for s in seqs]
        self.layers, self.lengths = [], []
        for i in range(len(caches[0].layers)):
            ks = [c.layers[i].keys for c in caches]
            vs = [c.layers[i].values for c in caches]
            n = max(k.shape[2] for k in ks)
            self.layers.append(_Layer(torch.cat([_left_pad(k, n) for k in ks]), torch.cat([_left_pad(v, n) for v in vs])))
            self.lengths.append([k.shape[2] for k in ks])
        self.masks = _masks(self, layer_types, seqs[0].block_size, device)

    def fits(self, seqs: list[UniformCanvasSequence]) -> bool:
        """Whether this cache is the stack of ``seqs``' caches as they are now."""
        return len(seqs) == len(self.versions) and all(s.kv_version is v for s, v in zip(seqs, self.versions))


def _left_pad(t: torch.Tensor, n: int) -> torch.Tensor:
    """``[1, H, T, D]`` zero-padded on the left to ``T = n``."""
    return t if t.shape[2] == n else torch.nn.functional.pad(t, (0, 0, n - t.shape[2], 0))


def _masks(stacked: _StackedCache, layer_types: list[str], C: int, device) -> dict | None:
    """Per layer type, ``[B, 1, C, K + C]`` bool (True = attend): each choice's own cached keys and the canvas;
    None when every choice's cache has the same length (no padding: ``generate()``'s own case)."""
    out = {}
    for kind in set(layer_types):
        lengths = stacked.lengths[layer_types.index(kind)]
        if len(set(lengths)) == 1:
            out[kind] = None
            continue
        K = max(lengths)
        keys = torch.arange(K + C, device=device)
        starts = torch.tensor([K - n for n in lengths], device=device)
        out[kind] = (keys[None, :] >= starts[:, None])[:, None, None, :].expand(-1, 1, C, -1)
    return out


def _decoder_cache(net, seqs: list[UniformCanvasSequence], device) -> tuple:
    """``(cache, masks)`` the decoder reads for ``seqs``: a lone choice's own cache, no masks; else the batch's
    :class:`_StackedCache`, reused from the last step while no choice has joined, left or encoded."""
    if len(seqs) == 1:
        return seqs[0].kv, {"full_attention": None, "sliding_attention": None}
    stacked = seqs[0].stacked
    if stacked is None or not stacked.fits(seqs):
        stacked = _StackedCache(seqs, net.config.text_config.layer_types, device)
        for s in seqs:
            s.stacked = stacked
    return stacked, stacked.masks


def _self_conditioning(seqs: list[UniformCanvasSequence], embed: torch.Tensor, device) -> tuple:
    """``(logits [B, C, V] or None, mask [B] bool or None)``: the previous step's tempered logits per choice, zeros
    and a False mask row for a choice at its canvas's first step (none at all when every choice is there)."""
    have = [s.sc is not None for s in seqs]
    if not any(have):
        return None, None
    sc = torch.cat([s.sc if s.sc is not None else torch.zeros(1, *seqs[0].current.shape[1:], embed.shape[0],
                                                               dtype=embed.dtype, device=device) for s in seqs])
    return sc, None if all(have) else torch.tensor(have, device=device)


@torch.inference_mode()
def step_uniform(model, seqs: list[UniformCanvasSequence], store=None) -> list[StepEvent]:
    """One step of every choice in ``seqs`` (a :class:`~unmask.engine.loaded.LoadedModel` of a uniform-canvas
    family): the encoder for those starting a canvas (one choice at a time, ``generate()``'s shapes; from and into
    ``store``, an :class:`~unmask.engine.encoder_prefix.EncoderPrefixStore`, when given), then one decoder forward
    over all of them, the row-wise math (temperature, softmax, argmax, entropy, acceptance) over the whole batch,
    then each choice's draws on its own rows from its own generator."""
    net = model.model
    for seq in seqs:
        if not seq.cur_step:
            seq.encode(model, store)
    dev = model.device
    canvas = torch.cat([s.current for s in seqs]).to(dev)
    positions = torch.cat([s.positions(dev) for s in seqs])
    embed = net.model.decoder.embed_tokens.weight
    sc, sc_mask = _self_conditioning(seqs, embed, dev)
    cache, masks = _decoder_cache(net, seqs, dev)
    logits = net(decoder_input_ids=canvas, self_conditioning_logits=sc, self_conditioning_mask=sc_mask,
                 decoder_attention_mask=masks, cache=cache, decoder_position_ids=positions).logits
    # per row, so each row's bits are those of its batch-1 computation
    processed = torch.cat([seq.temper(logits[i: i + 1]) for i, seq in enumerate(seqs)])
    probs = torch.softmax(processed, dim=-1, dtype=torch.float32)
    argmax = torch.argmax(processed, dim=-1)
    # transformers' own entropy (EntropyBoundSampler and the stopping rule build this Categorical), without its
    # argument check
    entropy = torch.distributions.Categorical(logits=processed, validate_args=False).entropy()  # [B, C]
    bounds = torch.tensor([seq.options.entropy_bound for seq in seqs], dtype=entropy.dtype, device=entropy.device)
    accept = entropy_bound_mask(entropy, bounds[:, None])
    confidence = probs.gather(-1, argmax[..., None])[..., 0]
    # the shown argmax, probability and log-probability of every row in one device-to-host copy (float64 holds the
    # ids and the float32 values exactly)
    host = torch.stack([argmax.to(torch.float64), confidence.to(torch.float64),
                        torch.log(confidence).to(torch.float64)]).cpu().tolist()  # [3, B, C]
    shown = zip([[int(t) for t in row] for row in host[0]], host[1], host[2])
    events = []
    for i, (seq, row_shown) in enumerate(zip(seqs, shown)):
        seq.nfe += 1
        row = slice(i, i + 1)
        events.append(seq.consume_logits(processed[row], probs[row], argmax[row], entropy[row], accept[row],
                                         row_shown, embed.dtype))
    return events
