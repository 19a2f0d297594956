"""One-command recipes (SmolLM2 A2D pipeline) and the prompt-set generator."""
