"""The uniform-canvas sampler's request options (DiffusionGemma; docs/design.md#decoding, "Uniform canvas") and
which other request fields it honours: transformers' ``DiffusionGemmaGenerationConfig`` names, its defaults, and the
refusals (a :class:`~unmask.engine.limits.ParamError` naming the field) of what the sampler does not do.

Fields (transformers 5.25, ``generation_diffusion_gemma.py``): ``max_denoising_steps`` (denoising steps per canvas at
most), ``t_min`` / ``t_max`` (the linear temperature schedule's last and first temperature), ``entropy_bound``
(``EntropyBoundSamplerConfig.entropy_bound``), ``stability_threshold`` / ``confidence_threshold`` (adaptive
stopping: the argmax canvas unchanged for that many steps and the mean token entropy below that). A request that
leaves one unset gets the checkpoint's ``generation_config.json`` value, else transformers' global default.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

from .limits import ParamError

__all__ = ["UniformCanvasOptions", "UNIFORM_CANVAS_FAMILIES", "uniform_canvas_options", "TRANSFORMERS_DEFAULTS",
           "describe_uniform_defaults"]

#: families decoded by the uniform-canvas sampler (``unmask.engine.uniform_canvas``)
UNIFORM_CANVAS_FAMILIES = ("diffusion_gemma",)
#: ``DiffusionGemmaGenerationConfig._get_default_generation_params()`` (transformers 5.25)
TRANSFORMERS_DEFAULTS = {"max_denoising_steps": 48, "t_min": 0.4, "t_max": 0.8, "entropy_bound": 0.1,
                         "stability_threshold": 1, "confidence_threshold": 0.005}

# request fields the sampler does not honour -> why (refused when set to anything but their neutral value:
# temperature 1, OpenAI's default, which clients send unasked, leaves the schedule as it is)
_REFUSED = {
    "temperature": "its temperature follows the linear schedule: set t_min / t_max",
    "steps": "its steps per canvas are max_denoising_steps",
    "threshold": "it accepts tokens by the entropy bound: set entropy_bound",
    "remasking": "it re-noises the tokens the entropy bound does not accept",
    "sub_block_size": "it refines the whole canvas",
    "cfg_scale": "classifier-free guidance is not part of its sampler",
    "top_k": "it samples the full tempered distribution", "top_p": "it samples the full tempered distribution",
    "presence_penalty": "penalties are not part of its sampler",
    "frequency_penalty": "penalties are not part of its sampler",
    "repetition_penalty": "penalties are not part of its sampler",
    "min_tokens": "its canvases are sampled whole; an EOS cannot be held back",
    "logprobs": "not recorded by the uniform-canvas sampler",
    "logit_bias": "not part of its sampler",
    "suffix": "infilling needs a masked canvas", "constraints": "fixed positions need a masked canvas",
    "speculative": "self-speculative decoding needs a prefix_causal model",
    "multi_block": "its canvases are decoded one after another",
    "editing_threshold": "token editing is LLaDA2.1's", "max_post_steps": "token editing is LLaDA2.1's",
}
_NEUTRAL = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0,
            "min_tokens": 0, "logprobs": False, "cfg_scale": 0.0, "speculative": False, "constraints": {},
            "suffix": "", "editing_threshold": 0.0}


@dataclass(frozen=True)
class UniformCanvasOptions:
    """The sampler's settings for one request (module docstring; transformers' names and defaults)."""

    max_denoising_steps: int = TRANSFORMERS_DEFAULTS["max_denoising_steps"]
    t_min: float = TRANSFORMERS_DEFAULTS["t_min"]
    t_max: float = TRANSFORMERS_DEFAULTS["t_max"]
    entropy_bound: float = TRANSFORMERS_DEFAULTS["entropy_bound"]
    stability_threshold: int = TRANSFORMERS_DEFAULTS["stability_threshold"]
    confidence_threshold: float = TRANSFORMERS_DEFAULTS["confidence_threshold"]

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))


def uniform_canvas_options(params, default_sampling: dict | None = None) -> UniformCanvasOptions:
    """The options of a (validated) :class:`~unmask.engine.params.SamplingParams` on a uniform-canvas family, with
    the checkpoint's ``default_sampling`` and transformers' defaults for unset fields.

    Raises:
        ParamError: a field the sampler does not honour (``_REFUSED``, named with why; the ``speculative_*``
            options); a grammar constraint (named by its field); ``t_max <= t_min`` (names ``t_max``, as
            transformers refuses it).
    """
    for name, why in _REFUSED.items():
        value = getattr(params, name, None)
        if value is None or value == _NEUTRAL.get(name, None) or value in ([], {}):
            continue
        raise ParamError(name, f"not supported by the uniform-canvas sampler (DiffusionGemma): {why}")
    opts = params.speculative_options
    if opts is not None:
        name = next(f for f in type(opts).FIELDS if getattr(opts, f) is not None)
        raise ParamError(f"speculative_{name}", "not supported by the uniform-canvas sampler (DiffusionGemma): "
                                                "self-speculative decoding needs a prefix_causal model")
    if params.constraint is not None:
        raise ParamError(params.constraint.field, "grammar constraints reveal one left-to-right prefix; the "
                                                  "uniform-canvas sampler (DiffusionGemma) samples whole canvases")
    defaults = default_sampling or {}
    values = {}
    for key in UniformCanvasOptions.keys():
        value = getattr(params, key, None)
        values[key] = value if value is not None else defaults.get(key, TRANSFORMERS_DEFAULTS[key])
    if values["t_max"] <= values["t_min"]:
        raise ParamError("t_max", f"must be > t_min ({values['t_min']}), got {values['t_max']}")
    # each value as its default's type (int steps and stability, float temperatures and bounds)
    return UniformCanvasOptions(**{key: type(TRANSFORMERS_DEFAULTS[key])(value) for key, value in values.items()})


def describe_uniform_defaults(canvas: int, default_sampling: dict | None = None) -> str:
    """The start-up log's line of what a request that sets nothing gets on a uniform-canvas family (canvases of
    ``canvas`` tokens; the checkpoint's ``default_sampling``, else transformers' defaults)."""
    d = {k: (default_sampling or {}).get(k, v) for k, v in TRANSFORMERS_DEFAULTS.items()}
    return (f"uniform canvases of {canvas} tokens refined for at most {d['max_denoising_steps']} steps each "
            f"(temperature {d['t_max']:g} -> {d['t_min']:g}, entropy bound {d['entropy_bound']:g}, stopping once "
            f"stable for {d['stability_threshold']} step(s) with mean entropy below {d['confidence_threshold']:g}) "
            f"unless sent")
