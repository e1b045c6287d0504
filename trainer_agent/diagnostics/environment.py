"""Pre-flight checks of the process environment: the launch, NCCL socket and kernel buffer settings
that decide how well the GPUs are kept busy. They are read and reported, never changed: the agent
is a guest in the user's process and on the user's node.

==========================  =====================================================================
``cuda_launch_blocking``    ``CUDA_LAUNCH_BLOCKING`` unset or ``0``. ``1`` makes every kernel
                            launch wait for the kernel to finish (a debugging aid): the host can no
                            longer queue work ahead of the GPU (warn; skip without CUDA)
``nccl_sockets``            ``NCCL_NSOCKS_PERTHREAD=4`` and ``NCCL_SOCKET_NTHREADS=2`` for NCCL's
                            socket transport: more sockets and helper threads per connection move
                            more of a 10-100 Gb/s link. NCCL refuses a product above 64 (warn when
                            unset or different; skip without NCCL or with one node)
``socket_buffers``          ``net.core.rmem_max`` and ``net.core.wmem_max`` at least 16 MiB
                            (16777216): smaller kernel socket buffers cap a TCP connection's
                            window, so cross-node collectives over sockets stall on the buffer,
                            not the link (warn below; skip with one node or where /proc is absent)
==========================  =====================================================================

Every function here is pure over its inputs (an environment mapping, a ``/proc`` reader), so the
checks are tested without touching the machine.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
import torch.distributed as dist

__all__ = ["EnvFacts", "SOCKET_BUFFER_BYTES", "NCCL_SOCKET_SETTINGS", "environment_checks", "read_proc"]

#: ``net.core.rmem_max`` / ``wmem_max`` recommended for cross-node training over sockets (16 MiB).
SOCKET_BUFFER_BYTES = 16 * 1024 * 1024
#: NCCL's socket transport: sockets per helper thread and helper threads per connection.
NCCL_SOCKET_SETTINGS = {"NCCL_NSOCKS_PERTHREAD": 4, "NCCL_SOCKET_NTHREADS": 2}
#: NCCL refuses NCCL_NSOCKS_PERTHREAD x NCCL_SOCKET_NTHREADS above this.
_NCCL_MAX_SOCKETS = 64


def read_proc(name: str) -> str | None:
    """The text of ``/proc/sys/<name with dots as slashes>``, None where it cannot be read."""
    try:
        return Path("/proc/sys", *name.split(".")).read_text().strip()
    except OSError:
        return None


class EnvFacts:
    """What the checks need to know of the job: whether CUDA is used, the collective backend,
    whether the job spans more than one node (world size above the local world size), and whether
    the node has InfiniBand devices (NCCL then prefers them to sockets)."""

    __slots__ = ("cuda", "backend", "multi_node", "infiniband")

    def __init__(self, *, cuda: bool, backend: str | None, multi_node: bool, infiniband: bool = False) -> None:
        self.cuda, self.backend, self.multi_node, self.infiniband = cuda, backend, multi_node, infiniband

    @classmethod
    def of_process(cls) -> EnvFacts:
        """The facts of this process: CUDA initialised, the default process group's backend, the
        node count from torchrun's ``LOCAL_WORLD_SIZE`` against the world size."""
        backend = dist.get_backend() if dist.is_available() and dist.is_initialized() else None
        world = dist.get_world_size() if backend is not None else 1
        local = _int_or_none(os.environ.get("LOCAL_WORLD_SIZE")) or world
        ib = Path("/sys/class/infiniband")
        return cls(cuda=torch.cuda.is_available() and torch.cuda.is_initialized(), backend=backend,
                   multi_node=world > local, infiniband=ib.is_dir() and any(ib.iterdir()))


def _int_or_none(text: str | None) -> int | None:
    try:
        return int(str(text).strip())
    except (TypeError, ValueError):
        return None


def _launch_blocking(env: Mapping[str, str], facts: EnvFacts) -> tuple[str, str, dict]:
    value = env.get("CUDA_LAUNCH_BLOCKING")
    if not facts.cuda:
        return "skip", "CUDA is not used", {}
    if value is None or value.strip() in ("", "0"):
        return "pass", "CUDA_LAUNCH_BLOCKING is off: kernel launches are queued ahead of the GPU", {"value": value}
    return ("warn", f"CUDA_LAUNCH_BLOCKING={value}: every kernel launch waits for the kernel to finish, so the host "
            "cannot queue work ahead of the GPU and utilisation drops; set CUDA_LAUNCH_BLOCKING=0 (or unset it) "
            "outside debugging", {"value": value})


def _nccl_sockets(env: Mapping[str, str], facts: EnvFacts) -> tuple[str, str, dict]:
    if facts.backend != "nccl":
        return "skip", f"the collectives do not use NCCL (backend {facts.backend or 'none'})", {}
    if not facts.multi_node:
        return "skip", "one node: NCCL's socket transport is not used between nodes", {}
    values = {name: env.get(name) for name in NCCL_SOCKET_SETTINGS}
    net = env.get("NCCL_NET", "").strip()
    if net and net.lower() != "socket":
        return "skip", f"NCCL_NET={net}: NCCL does not use its socket transport", values
    if facts.infiniband and not net and env.get("NCCL_IB_DISABLE", "0").strip() != "1":
        return "skip", "InfiniBand devices are present and NCCL_IB_DISABLE is not 1: NCCL uses InfiniBand", values
    numbers = {name: _int_or_none(v) for name, v in values.items()}
    if all(v is not None for v in numbers.values()):
        product = numbers["NCCL_NSOCKS_PERTHREAD"] * numbers["NCCL_SOCKET_NTHREADS"]  # type: ignore[operator]
        if product > _NCCL_MAX_SOCKETS:
            return ("warn", f"NCCL_NSOCKS_PERTHREAD x NCCL_SOCKET_NTHREADS = {product}: NCCL refuses more than "
                    f"{_NCCL_MAX_SOCKETS} sockets per connection", values)
    off = [f"{name}={values[name] if values[name] is not None else 'unset'} (recommended {want})"
           for name, want in NCCL_SOCKET_SETTINGS.items() if numbers[name] != want]
    if not off:
        return "pass", "NCCL_NSOCKS_PERTHREAD=4 and NCCL_SOCKET_NTHREADS=2", values
    return ("warn", "; ".join(off) + ": more sockets and helper threads per connection let NCCL's socket transport "
            "fill a fast link between nodes (NCCL only reads these at start-up)", values)


def _socket_buffers(read: Callable[[str], str | None], facts: EnvFacts) -> tuple[str, str, dict]:
    if not facts.multi_node:
        return "skip", "one node: no collective crosses the network", {}
    values = {name: _int_or_none(read(name)) for name in ("net.core.rmem_max", "net.core.wmem_max")}
    if any(v is None for v in values.values()):
        return "skip", "net.core.rmem_max / wmem_max cannot be read on this machine", values
    low = [f"{name} = {v}" for name, v in values.items() if v < SOCKET_BUFFER_BYTES]  # type: ignore[operator]
    if not low:
        return "pass", f"socket buffers of at least {SOCKET_BUFFER_BYTES} bytes", values
    return ("warn", f"{', '.join(low)}, below {SOCKET_BUFFER_BYTES}: a small kernel socket buffer caps each TCP "
            f"connection's window, so collectives between nodes wait on the buffer instead of the link; an "
            f"administrator sets `sysctl -w net.core.rmem_max={SOCKET_BUFFER_BYTES} "
            f"net.core.wmem_max={SOCKET_BUFFER_BYTES}`", values)


def environment_checks(env: Mapping[str, str], facts: EnvFacts,
                       read: Callable[[str], str | None] = read_proc) -> list[tuple[str, str, str, dict]]:
    """(name, status, detail, values) of each environment check, in the table's order."""
    return [("cuda_launch_blocking", *_launch_blocking(env, facts)),
            ("nccl_sockets", *_nccl_sockets(env, facts)),
            ("socket_buffers", *_socket_buffers(read, facts))]
