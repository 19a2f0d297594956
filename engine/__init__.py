"""unmask engine: block-wise iterative unmasking for diffusion language models.

Public API (vLLM style; the server imports only from here and from ``unmask.engine.limits``)::

    from unmask.engine import LLM, SamplingParams
    llm = LLM("path/to/checkpoint")
    print(llm.generate("Hello", SamplingParams(max_tokens=32, temperature=0))[0].outputs[0].text)
"""
import logging as _logging

from .config import CheckpointError, DllmConfig
from .limits import ParamError
from .outputs import CompletionOutput, RequestOutput, Revealed, StepEvent
from .params import CONSTRAINT_KINDS, Constraint, SamplingParams

__all__ = ["LLM", "Engine", "AsyncEngine", "RequestStream", "SamplingParams", "SpeculativeOptions", "ParamError",
           "DllmConfig", "CheckpointError", "load_model", "RequestOutput", "CompletionOutput", "StepEvent",
           "Revealed", "QueueFull", "CacheFull", "EngineError", "EngineClosed", "encode_prompt", "chat_prompt_ids",
           "encode_text", "encode_plain", "TokenTexts", "DecodingPlan", "Constraint", "CONSTRAINT_KINDS", "check_constraint",
           "check_first_forward", "SelfCheckError", "EngineConfig", "option", "options_of", "with_options",
           "EngineDefaults", "route_keys", "EventStream"]

_LAZY = {  # name -> module: importing the package must not import torch-heavy modules eagerly
    "LLM": "llm", "encode_prompt": "llm", "chat_prompt_ids": "llm",
    "Engine": "engine", "AsyncEngine": "async_engine", "RequestStream": "async_engine",
    "EngineError": "async_engine", "EngineClosed": "async_engine",
    "QueueFull": "scheduler", "CacheFull": "scheduler",
    "load_model": "model", "TokenTexts": "detokenize", "SpeculativeOptions": "params", "DecodingPlan": "plan",
    "check_constraint": "constraints", "encode_text": "text_ids", "encode_plain": "text_ids",
    "check_first_forward": "self_check", "SelfCheckError": "self_check",
    "EngineConfig": "options", "option": "options", "options_of": "options", "with_options": "options",
    "EngineDefaults": "plan", "route_keys": "prefix_cache", "EventStream": "event_stream",
}


def __getattr__(name):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(name)
    import importlib

    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


class _NoKernelHubNotice(_logging.Filter):
    """Drops the two records bitsandbytes' import writes on a CPU with AVX512-BF16 when its optional kernel from the
    Hugging Face kernel hub (``kernels-community/quantization-bitsandbytes``) does not load (offline, or its
    publisher unverified): "Failed to load CPU gemm_4bit_forward from kernels-community ... trust_remote_code" and
    the ``kernels`` package's "Skipping publisher trust check" for that repository. bitsandbytes then runs its own
    bundled kernels, as unmask expects; every other record of those loggers passes."""

    def filter(self, record: _logging.LogRecord) -> bool:
        msg = record.getMessage()
        return not (msg.startswith("Failed to load CPU gemm_4bit_forward from kernels-community")
                    or ("'kernels-community/quantization-bitsandbytes'" in msg and "trust check" in msg))


for _name in ("bitsandbytes.backends.cpu.ops", "kernels._internals.hf_hub"):  # where bitsandbytes 0.50 /
    _logging.getLogger(_name).addFilter(_NoKernelHubNotice())                 # kernels 0.19 log them
