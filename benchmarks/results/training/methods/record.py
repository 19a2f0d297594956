"""Record the trajectory run's trajectories ahead of its training (same settings as the trainer would use)."""
from unmask.engine.model import load_model
from unmask.training.data import eos_ids_of, load_dataset
from unmask.training.trajectory import ensure_trajectories

M = "/root/.cache/unmask/models/smollm2-135m-a2d"
model = load_model(M, device="cpu")
eos = set(eos_ids_of(model.tokenizer, extra=model.dllm.eos_token_ids))
ds = load_dataset("train.jsonl", model.tokenizer, 128, eos)
import time
t = time.time()
ensure_trajectories("train.trajectory.jsonl", ds.examples, M, "engine", 0.9, 8, model=model, progress=True, block_size=4)
print("recorded in", round(time.time() - t, 1), "s")
