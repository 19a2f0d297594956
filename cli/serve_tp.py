"""``unmask serve --tensor-parallel-size N``: the tensor-parallel group's processes (docs/scale.md;
``unmask.engine.tensor_parallel`` has the design).

The serve process is rank 0 (the HTTP server and the engine loop); :func:`start_group` starts ranks 1..N-1 as
``python -m unmask.cli.serve_tp RANK FILE`` (FILE: the pickled options), joins the group with them (gloo on CPU,
NCCL on CUDA; ``--tensor-parallel-timeout`` for the forwards' collectives), and every rank then loads and shards
the model the same way (:func:`unmask.cli.serve.load_checked`). Ranks 1..N-1 replay rank 0's engine calls until
it stops. Rank 0 watches its engine: when the group fails (a rank died, a collective timed out) the server shuts
down gracefully (open streams get an error event) and exits 1 with the reason.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
import tempfile
import threading

log = logging.getLogger("unmask.server")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Group:
    """Rank 0's view of the other ranks: their processes, the engine watch, the exit status."""

    def __init__(self, procs: list[subprocess.Popen], options_file: str):
        self.procs, self.options_file = procs, options_file
        self.failure: BaseException | None = None

    def watch(self, engine) -> None:
        """Stop the server (SIGTERM to this process: uvicorn's graceful shutdown) when ``engine``'s thread dies of
        a group failure."""
        from unmask.engine.tensor_parallel import TensorParallelError

        def run():
            while engine.alive:
                threading.Event().wait(0.2)
            if isinstance(engine.error, TensorParallelError):
                self.failure = engine.error
                log.error("%s; stopping the server", engine.error)
                os.kill(os.getpid(), signal.SIGTERM)

        threading.Thread(target=run, name="unmask-tp-watch", daemon=True).start()

    def stop(self, timeout: float = 30.0) -> None:
        """Tell the other ranks to exit and wait for them (killed after ``timeout`` seconds)."""
        from unmask.engine.tensor_parallel import stop_followers

        if self.failure is None:
            stop_followers()
        for p in self.procs:
            try:
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                p.kill()
        try:
            os.unlink(self.options_file)
        except OSError:
            pass

    def status(self, status: int) -> int:
        """The serve command's exit status: 1 after a group failure."""
        return 1 if self.failure is not None else status


def start_group(args: argparse.Namespace, config):
    """Start ranks 1..N-1 and join the group as rank 0: ``(Group, rank 0's config)``.

    Raises:
        UsageError: the group did not form within ``--tensor-parallel-timeout`` (a rank failed to start).
    """
    from unmask.cli.main import UsageError
    from unmask.cli.serve import OPTION_FIELDS
    from unmask.engine.tensor_parallel import init_group, rank_device

    world, port = config.tensor_parallel_size, _free_port()
    if rank_device(config.device, 0) != "cpu":
        import torch

        if torch.cuda.device_count() < world:  # one GPU per rank
            raise UsageError(f"--tensor-parallel-size: {world} ranks need {world} GPUs, this machine has "
                             f"{torch.cuda.device_count()}")
    kept = argparse.Namespace(**{k: v for k, v in vars(args).items() if k in OPTION_FIELDS or k == "env_origins"})
    fd, path = tempfile.mkstemp(prefix="unmask-tp-", suffix=".pickle")
    with os.fdopen(fd, "wb") as f:
        pickle.dump({"args": kept, "config": config, "port": port}, f)
    procs = [subprocess.Popen([sys.executable, "-m", "unmask.cli.serve_tp", str(rank), path])
             for rank in range(1, world)]
    group = Group(procs, path)
    device = rank_device(config.device, 0)
    try:
        init_group(0, world, "127.0.0.1", port, config.tensor_parallel_timeout, device)
    except Exception as exc:
        group.failure = exc
        group.stop(timeout=5)
        raise UsageError(f"--tensor-parallel-size: the group of {world} processes did not form: "
                         f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}") from exc
    return group, dataclasses.replace(config, device=device) if device != "cpu" else config


def main(argv: list[str]) -> int:
    """Rank ``argv[0]`` of the group whose options are in the file ``argv[1]``: join, load and shard the model,
    then replay rank 0's engine calls until it stops. Returns the exit status (1 when the group failed)."""
    from unmask.cli.serve import load_checked
    from unmask.engine.engine import Engine
    from unmask.engine.tensor_parallel import follow, follower_exit_code, init_group, rank_device

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    rank = int(argv[0])
    with open(argv[1], "rb") as f:
        options = pickle.load(f)
    args, config = options["args"], options["config"]
    config = dataclasses.replace(config, device=rank_device(config.device, rank))
    try:
        init_group(rank, config.tensor_parallel_size, "127.0.0.1", options["port"], config.tensor_parallel_timeout,
                   config.device)
        loaded, config, _, _ = load_checked(args, config)
        follow(Engine(loaded, config))
    except BaseException as exc:  # the group failed or rank 0 left: say why, exit 1
        return follower_exit_code(exc)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
