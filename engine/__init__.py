"""unmask engine: block-wise iterative unmasking for diffusion language models.

Public API (vLLM style)::

    from unmask.engine import LLM, SamplingParams
    llm = LLM("path/to/checkpoint")
    print(llm.generate("Hello", SamplingParams(max_tokens=32, temperature=0))[0].outputs[0].text)
"""
from .config import CheckpointError, DllmConfig
from .params import ParamError, SamplingParams

__all__ = ["LLM", "SamplingParams", "ParamError", "DllmConfig", "CheckpointError", "AsyncEngine", "load_model",
           "RequestOutput", "CompletionOutput", "StepEvent"]


def __getattr__(name):  # lazy: importing the package must not import torch-heavy modules eagerly
    if name == "LLM":
        from .llm import LLM
        return LLM
    if name == "AsyncEngine":
        from .async_engine import AsyncEngine
        return AsyncEngine
    if name == "load_model":
        from .model import load_model
        return load_model
    if name in ("RequestOutput", "CompletionOutput"):
        from . import outputs
        return getattr(outputs, name)
    if name == "StepEvent":
        from .sequence import StepEvent
        return StepEvent
    raise AttributeError(name)
