"""``tensor_parallel_size=N`` on one host: start N rank processes
(``python -m tokenbudget.worker --rank R ...`` on a loopback rendezvous) and
drive rank 0 as a remote worker; rank 0 fans each step out to the others.

The ranks are separate processes even for rank 0, so a rank that dies takes
only the group down: the engine sees the failed step, fails its in-flight
requests with the reason (the server: NOT_SERVING) and stays up; its
reconnection (``reinitialize``) starts a fresh group.
"""

from __future__ import annotations

import os
import queue
import socket
import subprocess
import sys
import threading
import time

from tokenbudget.core.lora import LoRAConfig
from tokenbudget.core.outputs import KVCacheSpec
from tokenbudget.server.executor.remote import RemoteExecutor, WorkerUnavailableError

_READY = "tokenbudget worker listening on "


class LocalRanks:
    """The N rank processes of one group on this host."""

    def __init__(
        self,
        world_size: int,
        *,
        threads: int = 1,
        dist_timeout_s: float = 300.0,
        start_timeout_s: float = 300.0,
    ) -> None:
        if world_size < 2:
            raise ValueError(f"tensor_parallel_size must be >= 2 for a group, got {world_size}")
        init = f"tcp://127.0.0.1:{_free_port()}"
        env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
        self.procs: list[subprocess.Popen] = []
        for rank in range(world_size):
            # --parent-pid: rank 0 stops when this process is gone (the others follow
            # it), so no rank outlives the engine that started it.
            argv = [
                sys.executable,
                "-m",
                "tokenbudget.worker",
                "--rank",
                str(rank),
                "--world-size",
                str(world_size),
                "--dist-init",
                init,
                "--host",
                "127.0.0.1",
                "--port",
                "0",
                "--threads",
                str(threads),
                "--dist-timeout",
                str(dist_timeout_s),
                "--parent-pid",
                str(os.getpid()),
            ]
            self.procs.append(
                subprocess.Popen(
                    argv,
                    env=env,
                    stdout=subprocess.PIPE if rank == 0 else subprocess.DEVNULL,
                    text=True,
                )
            )
        self.address = self._wait_ready(start_timeout_s)

    def _wait_ready(self, timeout_s: float) -> str:
        lines: queue.SimpleQueue = queue.SimpleQueue()

        def pump() -> None:  # rank 0's stdout: the readiness line, then drained
            for line in self.procs[0].stdout:
                lines.put(line)
            lines.put(None)

        threading.Thread(target=pump, daemon=True, name="tokenbudget-tp-rank0-out").start()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            dead = [r for r, p in enumerate(self.procs) if p.poll() is not None]
            if dead:
                self.stop()
                raise WorkerUnavailableError(
                    f"tensor-parallel rank {dead[0]} exited during start-up (status "
                    f"{self.procs[dead[0]].returncode}); see its log above"
                )
            try:
                line = lines.get(timeout=0.2)
            except queue.Empty:
                continue
            if line is not None and line.startswith(_READY):
                return line[len(_READY) :].strip()
        self.stop()
        raise WorkerUnavailableError(
            f"the tensor-parallel ranks did not start within {timeout_s:g} s"
        )

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM to rank 0, which tells the others to stop; whatever is still
        running at the deadline is killed."""
        if self.procs[0].poll() is None:
            self.procs[0].terminate()
        deadline = time.monotonic() + timeout_s
        for p in self.procs:
            try:
                p.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


class TensorParallelExecutor(RemoteExecutor):
    """The Executor over a local tensor-parallel group."""

    connect_timeout_flag = ""  # ranks this process starts: no flag sets the wait

    def __init__(
        self,
        model: str,
        tensor_parallel_size: int,
        *,
        dtype: str = "auto",
        device: str = "",
        attention_backend: str = "auto",
        enforce_eager: bool | None = None,
        lora_config: LoRAConfig | None = None,
        threads: int | None = None,
        dist_timeout_s: float = 300.0,
        step_timeout: float = 0.0,
        hang_timeout: float = 0.0,
    ) -> None:
        """``threads``: torch threads per rank (default: this process's share
        of torch's, so the ranks do not oversubscribe the cores);
        ``step_timeout``, ``hang_timeout``: as RemoteExecutor's (0: rely on
        ``dist_timeout_s``)."""
        from tokenbudget.worker.loader import check_supported
        from tokenbudget.core.utils.model_source import load_config
        from tokenbudget.worker.parallel.sharding import check_tensor_parallel_size

        # Refused before any process starts.
        self.config = load_config(model)
        check_supported(self.config, model)
        check_tensor_parallel_size(self.config.get_text_config(), tensor_parallel_size)
        if threads is None:
            import torch

            threads = max(1, torch.get_num_threads() // tensor_parallel_size)
        self._start = lambda: LocalRanks(
            tensor_parallel_size, threads=threads, dist_timeout_s=dist_timeout_s
        )
        self.ranks = self._start()
        super().__init__(
            [self.ranks.address],
            model,
            dtype=dtype,
            device=device,
            attention_backend=attention_backend,
            enforce_eager=enforce_eager,
            lora_config=lora_config,
            step_timeout=step_timeout,
            hang_timeout=hang_timeout,
        )

    def initialize(self, cache_config, scheduler_config) -> KVCacheSpec:
        try:
            return super().initialize(cache_config, scheduler_config)
        except BaseException:
            self.shutdown()
            raise

    def reinitialize(self, connect_timeout: float = 2.0) -> KVCacheSpec:
        """After a failure (the engine retries with backoff): a broken group
        cannot be mended, so stop what is left of it, start a fresh one and
        initialise it with the same configuration."""
        self.ranks.stop()
        self.ranks = self._start()
        self._addresses = [self.ranks.address]
        return super().reinitialize(connect_timeout)

    def shutdown(self) -> None:
        super().shutdown()
        # SIGTERM: rank 0 tells the others to stop, then exits.
        self.ranks.stop()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
