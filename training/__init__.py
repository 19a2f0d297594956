"""unmask training: AR -> diffusion adaptation (A2D) whose outputs the engine serves (docs/design.md#training).

Modules: ``convert`` (AR checkpoint or GGUF -> ``a2d`` checkpoint with a mask token), ``realmodel`` (the offline
SmolLM2-135M GGUF and the default converted model), data, losses, trainer, distillation and export.
"""
