"""Where this process sits in a torch.distributed job: rank, world size, device.

nvtrain does not launch processes; ``torchrun`` (single or multi node) does, and
describes the job in environment variables. :class:`DistributedManager` reads
them once, initialises ``torch.distributed`` when the job has more than one
process (NCCL with CUDA, gloo otherwise) and tells the strategy and plugins
the answer. A plain ``python train.py`` is a world of one and needs no
environment at all. NCCL needs a GPU of its own for every process: a node
that starts more processes than it has GPUs is refused with
:class:`DeviceAssignmentError`, which says how to fix the launch.

:func:`unwrap_model` gives the module under a data-parallel (or compiled)
wrapper; checkpoints and averaged weights are taken from it so they load into
a plain model.
"""

from __future__ import annotations

import datetime
import gc
import os
import sys
import warnings
from collections.abc import Mapping
from typing import Any, ClassVar, final

import attrs
import torch
import torch.distributed as dist

if dist.is_available():
    # torch.distributed.nn.functional binds the default process group into its functions'
    # default arguments when it is first imported, which torch does lazily (the first
    # optimizer imports it through torch._dynamo). Imported while a group exists, it keeps
    # that group alive after destroy_process_group(), and the group's gloo threads are then
    # torn down at interpreter exit, which aborts a finished rank now and then ("terminate
    # called without an active exception", SIGABRT). Imported here, before nvtrain or the
    # user creates a group, it binds None.
    import torch.distributed.nn

__all__ = [
    "DeviceAssignmentError",
    "DistributedManager",
    "TorchrunEnv",
    "backend_for",
    "default_backend",
    "dtensor_type",
    "malformed_backend",
    "unknown_backend",
    "unwrap_model",
]


class DeviceAssignmentError(RuntimeError):
    """More processes on a node than CUDA devices for them, with a backend (NCCL) that needs one each.

    Raised by :meth:`DistributedManager.initialize` on every rank of the node, before any
    process group exists, so no rank waits for the others at a rendezvous that cannot work.
    """


@attrs.frozen
class TorchrunEnv:
    """The torchrun environment variables of this process, parsed and checked.

    ``torchrun`` sets ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
    ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` for every worker.
    Without them (a plain ``python`` run) this is a world of one.
    """

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    master_addr: str | None = None
    master_port: int | None = None

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> TorchrunEnv:
        """Read and check the variables; errors name the variable and what it held."""
        env = os.environ if environ is None else environ
        world_size = _env_int(env, "WORLD_SIZE", 1, minimum=1)
        rank = _env_int(env, "RANK", 0, minimum=0)
        if world_size > 1 and "RANK" not in env:
            raise ValueError(
                f"DistributedManager: WORLD_SIZE={world_size} but RANK is not set; launch with torchrun "
                "(or set RANK, LOCAL_RANK, MASTER_ADDR and MASTER_PORT for every process)"
            )
        if rank >= world_size:
            raise ValueError(f"DistributedManager: RANK={rank} must be smaller than WORLD_SIZE={world_size}")
        local_rank = _env_int(env, "LOCAL_RANK", rank if world_size > 1 and "LOCAL_RANK" not in env else 0, minimum=0)
        local_world_size = _env_int(env, "LOCAL_WORLD_SIZE", world_size, minimum=1)
        master_addr = env.get("MASTER_ADDR") or None
        master_port = _env_int(env, "MASTER_PORT", 0, minimum=1) if "MASTER_PORT" in env else None
        if world_size > 1 and (master_addr is None or master_port is None):
            missing = [
                name for name, value in (("MASTER_ADDR", master_addr), ("MASTER_PORT", master_port)) if value is None
            ]
            raise ValueError(
                f"DistributedManager: WORLD_SIZE={world_size} but {' and '.join(missing)} "
                f"{'is' if len(missing) == 1 else 'are'} not set; torchrun sets them (--master-addr/--master-port "
                "or a rendezvous endpoint)"
            )
        return cls(
            rank=rank,
            local_rank=local_rank,
            world_size=world_size,
            local_world_size=local_world_size,
            master_addr=master_addr,
            master_port=master_port,
        )


def _env_int(env: Mapping[str, str], name: str, default: int, *, minimum: int) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"DistributedManager: environment variable {name} must be an integer (got {raw!r})") from None
    if value < minimum:
        raise ValueError(f"DistributedManager: environment variable {name} must be >= {minimum} (got {value})")
    return value


def default_backend(device: torch.device) -> str:
    """NCCL for CUDA devices (when built with it), gloo otherwise."""
    if device.type == "cuda" and dist.is_nccl_available():
        return "nccl"
    return "gloo"


#: Backends that serve only some device types; every other one (gloo, mpi, ucc) serves all of them.
_DEVICE_TYPES_OF = {"nccl": ("cuda",), "xccl": ("xpu",)}


def backend_for(spec: str, device_type: str) -> str | None:
    """The backend a process group of backend ``spec`` uses for tensors of ``device_type``: ``spec`` itself
    (``"gloo"``, ``"nccl"``), or the one a ``"cpu:gloo,cuda:nccl"`` pair names; None when it has none (NCCL
    has none for the CPU)."""
    spec = spec.strip().lower()
    if ":" not in spec:
        served = _DEVICE_TYPES_OF.get(spec)
        return spec if served is None or device_type in served else None
    for pair in spec.split(","):
        device, _, backend = pair.partition(":")
        if device.strip() == device_type:
            return backend.strip()
    return None


def malformed_backend(spec: str) -> str | None:
    """Why torch's ``init_process_group`` would refuse ``spec`` as written, before its names are looked at; None
    when it has the form of a backend (``"gloo"``) or of ``device:backend`` pairs (``"cpu:gloo,cuda:nccl"``)."""
    if not spec:
        return "it is empty"
    if any(char.isspace() for char in spec):
        return "it holds whitespace, which torch keeps in the names it reads"
    if ":" not in spec:
        return "',' joins device:backend pairs, not backends" if "," in spec else None
    devices: list[str] = []
    for part in spec.split(","):
        device, sep, backend = part.partition(":")
        if not sep or not device or not backend or ":" in backend:
            return f"{part!r} is not a device:backend pair"
        if device.lower() in devices:
            return f"device {device!r} is named twice"
        devices.append(device.lower())
    return None


def unknown_backend(spec: str) -> tuple[str | None, list[str]]:
    """The first name in ``spec`` (a backend, or ``"cpu:gloo,cuda:nccl"`` pairs) that torch.distributed does not
    know (None when it knows them all), and the names it knows: for a refusal that names both."""
    known = [name for name in dist.Backend.backend_list if name != dist.Backend.UNDEFINED]
    pairs = [part.partition(":") for part in spec.lower().split(",")]
    names = [name if sep else device for device, sep, name in pairs]
    return next((name for name in names if name not in known), None), known


def _default_device(local_rank: int) -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def _as_device(value: str | torch.device | None) -> torch.device | None:
    if value is None or value == "auto":  # "auto": the config's word for the default
        return None
    if isinstance(value, torch.device):
        return value
    if not isinstance(value, str) or not value:
        raise ValueError(
            f"DistributedManager.initialize: device must be a torch device like 'cpu', 'cuda' or 'cuda:1', "
            f"or None / 'auto' (got {value!r})"
        )
    try:
        return torch.device(value)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"DistributedManager.initialize: device {value!r} is not a torch device ({err})") from None


def _process_device(
    requested: torch.device | None, local_rank: int, local_world_size: int, world_size: int, backend: str | None
) -> torch.device:
    """The device of this process: ``requested``, else ``cuda:LOCAL_RANK`` with CUDA, else the CPU.

    ``cuda`` without an index means ``cuda:LOCAL_RANK``; an explicit index is used as given.
    With several processes and NCCL (given, or chosen for a CUDA device) each process of the
    node needs a GPU of its own: NCCL refuses two ranks on one device ("invalid usage"),
    so a node with more processes than visible GPUs is refused here, on every rank alike.
    """
    if requested is not None and requested.type != "cuda":
        return requested
    if requested is not None and not torch.cuda.is_available():
        raise ValueError(
            f"DistributedManager.initialize: device {str(requested)!r} asks for CUDA, which this process does not "
            "have (torch.cuda.is_available() is False); use device='cpu'"
        )
    if requested is None and not torch.cuda.is_available():
        return torch.device("cpu")
    count = torch.cuda.device_count()
    if requested is not None and requested.index is not None:
        if requested.index >= count:
            raise ValueError(
                f"DistributedManager.initialize: device {str(requested)!r} but {count} CUDA device(s) are visible"
            )
        return requested
    chosen = backend or default_backend(torch.device("cuda", 0))
    if world_size > 1 and backend_for(chosen, "cuda") == "nccl" and max(local_world_size, local_rank + 1) > count:
        processes = max(local_world_size, local_rank + 1)
        raise DeviceAssignmentError(
            f"DistributedManager: {processes} processes on this node (LOCAL_WORLD_SIZE={local_world_size}) but "
            f"{count} CUDA device(s) visible, and NCCL needs a GPU of its own for every process. Start at most "
            f"{count} process(es) per node (torchrun --nproc-per-node={count}), or train on the CPU with gloo: "
            "`nvtrain train ... --set device=cpu`, DistributedManager.initialize(device='cpu') in a script, "
            "or CUDA_VISIBLE_DEVICES= to hide the GPUs"
        )
    return torch.device("cuda", local_rank % count)


@attrs.frozen
class _State:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    device: torch.device = attrs.field(factory=lambda: torch.device("cpu"))
    backend: str | None = None
    #: The job trains over torch.distributed's default group. Not the group object itself: this
    #: class-level state outlives the run, and a group still referenced after
    #: destroy_process_group() lives on to interpreter exit (see the module's import above).
    uses_default_group: bool = False
    owns_process_group: bool = False
    initialized: bool = False
    find_unused_parameters: bool = False
    broadcast_buffers: bool = False
    #: The process group's timeout as ``initialize`` was given it (None: torch's default, or an adopted group).
    timeout: datetime.timedelta | None = None


def _ignored_requests(state: _State, **requested: Any) -> list[str]:
    """What a second :meth:`DistributedManager.initialize` asks for that the existing manager does not have."""
    ignored = []
    device = requested["device"]
    if device is not None and not (
        device.type == state.device.type and (device.index is None or device.index == state.device.index)
    ):
        ignored.append(f"device={str(device)!r} is ignored (the manager trains on {str(state.device)!r})")
    backend = requested["backend"]
    if backend is not None and backend != state.backend:
        ignored.append(f"backend={backend!r} is ignored (the manager's is {state.backend!r})")
    timeout = requested["timeout"]
    if timeout is not None and timeout != state.timeout:
        ignored.append(f"timeout={timeout} is ignored (the process group exists)")
    for flag in ("find_unused_parameters", "broadcast_buffers"):
        value = requested[flag]
        if value is not None and value != getattr(state, flag):
            ignored.append(
                f"{flag}={value} is ignored (the manager's is {getattr(state, flag)}; set manager.{flag} to change it)"
            )
    return ignored


@final
class DistributedManager:
    """One view, shared by every instance, of this process's place in the job.

    Call :meth:`initialize` once at the start of the program, then build as many
    ``DistributedManager()`` as you like: they all read the same state. Before
    ``initialize()`` an instance describes a single process on the default
    device (``cuda:0`` or CPU)::

        DistributedManager.initialize()        # reads torchrun's environment
        manager = DistributedManager()
        strategy = TrainingStrategy(..., distributed_manager=manager)
        ...
        DistributedManager.cleanup()           # destroys only what initialize() created

    ``find_unused_parameters`` and ``broadcast_buffers`` are the defaults the
    DDP plugin uses when its own fields are ``None``.
    """

    _state: ClassVar[_State | None] = None

    __slots__ = ()

    # -- lifecycle -------------------------------------------------------------------

    @classmethod
    def initialize(
        cls,
        *,
        device: str | torch.device | None = None,
        backend: str | None = None,
        timeout: datetime.timedelta | None = None,
        find_unused_parameters: bool | None = None,
        broadcast_buffers: bool | None = None,
    ) -> DistributedManager:
        """Read torchrun's environment; with ``WORLD_SIZE > 1`` initialise ``torch.distributed``.

        The device is ``device`` when given (``"cuda"`` without an index means
        ``cuda:LOCAL_RANK``; ``"cpu"`` trains on the CPU with gloo even where GPUs are
        visible), else ``cuda:LOCAL_RANK`` when CUDA is available, else the CPU; a CUDA
        device is made the current device. The backend is ``backend`` or NCCL with CUDA
        and gloo otherwise. With NCCL and more processes on this node than visible
        GPUs it raises :class:`DeviceAssignmentError` (saying what to change) before any
        process group is created. If ``torch.distributed`` is already initialised (by
        your code), it is adopted and :meth:`cleanup` leaves it alone. Calling
        ``initialize()`` again returns the existing manager; one that asks for another
        device, backend or DDP default than the manager has warns, naming what it
        ignores (call :meth:`cleanup` first to start over).
        """
        for name, value in (
            ("find_unused_parameters", find_unused_parameters),
            ("broadcast_buffers", broadcast_buffers),
        ):
            if value is not None and not isinstance(value, bool):
                raise TypeError(f"DistributedManager.initialize: {name} must be a bool (got {value!r})")
        if backend is not None and (not isinstance(backend, str) or not backend):
            raise ValueError(
                f"DistributedManager.initialize: backend must be a non-empty str or None (got {backend!r})"
            )
        requested = _as_device(device)
        if cls._state is not None and cls._state.initialized:
            ignored = _ignored_requests(
                cls._state,
                device=requested,
                backend=backend,
                timeout=timeout,
                find_unused_parameters=find_unused_parameters,
                broadcast_buffers=broadcast_buffers,
            )
            if ignored:
                warnings.warn(
                    f"DistributedManager.initialize: already initialised, so {'; '.join(ignored)}. It returns the "
                    "existing manager; call DistributedManager.cleanup() first to initialise with other settings",
                    stacklevel=2,
                )
            return cls()
        find_unused_parameters = bool(find_unused_parameters)
        broadcast_buffers = bool(broadcast_buffers)
        if dist.is_available() and dist.is_initialized():
            rank, world_size = dist.get_rank(), dist.get_world_size()
            env = TorchrunEnv.from_environ()
            local_rank = env.local_rank if env.world_size == world_size else rank
            local_world_size = env.local_world_size if env.world_size == world_size else world_size
            device = _process_device(requested, local_rank, local_world_size, world_size, str(dist.get_backend()))
            if device.type == "cuda":
                torch.cuda.set_device(device)
            cls._state = _State(
                rank=rank,
                local_rank=local_rank,
                world_size=world_size,
                local_world_size=local_world_size,
                device=device,
                backend=str(dist.get_backend()),
                uses_default_group=True,
                owns_process_group=False,
                initialized=True,
                find_unused_parameters=find_unused_parameters,
                broadcast_buffers=broadcast_buffers,
            )
            return cls()
        env = TorchrunEnv.from_environ()
        device = _process_device(requested, env.local_rank, env.local_world_size, env.world_size, backend)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        state = _State(
            rank=env.rank,
            local_rank=env.local_rank,
            world_size=env.world_size,
            local_world_size=env.local_world_size,
            device=device,
            initialized=True,
            find_unused_parameters=find_unused_parameters,
            broadcast_buffers=broadcast_buffers,
        )
        if env.world_size > 1:
            if not dist.is_available():
                raise RuntimeError(
                    f"DistributedManager.initialize: WORLD_SIZE={env.world_size} but this torch build has no "
                    "torch.distributed support"
                )
            chosen = backend or default_backend(device)
            kwargs: dict[str, Any] = {}
            if timeout is not None:
                kwargs["timeout"] = timeout
            dist.init_process_group(
                backend=chosen, init_method="env://", rank=env.rank, world_size=env.world_size, **kwargs
            )
            state = attrs.evolve(
                state, backend=chosen, uses_default_group=True, owns_process_group=True, timeout=timeout
            )
        cls._state = state
        return cls()

    @classmethod
    def is_initialized(cls) -> bool:
        """Whether :meth:`initialize` ran (and :meth:`cleanup` has not)."""
        return cls._state is not None and cls._state.initialized

    @classmethod
    def cleanup(cls) -> None:
        """Destroy the process group if :meth:`initialize` created it; forget the state."""
        state = cls._state
        cls._state = None
        if state is not None and state.owns_process_group and dist.is_initialized():
            # What the run leaves in reference cycles (a strategy and its context, a DDP wrapper's
            # autograd hooks, an FSDP module and its state) may hold the group; freed later, at
            # interpreter exit at worst, it would destroy gloo's group there, which aborts the
            # process now and then. Collect it while the group is alive.
            gc.collect()
            dist.destroy_process_group()

    # -- the view ----------------------------------------------------------------------

    @classmethod
    def _current(cls) -> _State:
        state = cls._state
        if state is None:
            state = _State(device=_default_device(0))
        return state

    @property
    def rank(self) -> int:
        """Global rank of this process (0 in a single process)."""
        return self._current().rank

    @property
    def local_rank(self) -> int:
        """Rank of this process on its node (picks the GPU)."""
        return self._current().local_rank

    @property
    def world_size(self) -> int:
        """Number of processes in the job."""
        return self._current().world_size

    @property
    def local_world_size(self) -> int:
        """Number of processes on this node."""
        return self._current().local_world_size

    @property
    def device(self) -> torch.device:
        """``cuda:LOCAL_RANK`` with CUDA, else the CPU."""
        return self._current().device

    @property
    def backend(self) -> str | None:
        """The torch.distributed backend in use, or None in a single process."""
        return self._current().backend

    @property
    def process_group(self) -> Any:
        """The process group for data parallelism (the default group), or None when not distributed.

        None also once the default group has been destroyed.
        """
        if self._current().uses_default_group and dist.is_available() and dist.is_initialized():
            return dist.group.WORLD
        return None

    @property
    def is_distributed(self) -> bool:
        """Whether a torch.distributed process group is in use."""
        return self.process_group is not None

    @property
    def find_unused_parameters(self) -> bool:
        """Default for ``DistributedDataParallel(find_unused_parameters=...)``."""
        return self._current().find_unused_parameters

    @find_unused_parameters.setter
    def find_unused_parameters(self, value: bool) -> None:
        self._set_flag("find_unused_parameters", value)

    @property
    def broadcast_buffers(self) -> bool:
        """Default for ``DistributedDataParallel(broadcast_buffers=...)``."""
        return self._current().broadcast_buffers

    @broadcast_buffers.setter
    def broadcast_buffers(self, value: bool) -> None:
        self._set_flag("broadcast_buffers", value)

    @classmethod
    def _set_flag(cls, name: str, value: bool) -> None:
        if not isinstance(value, bool):
            raise TypeError(f"DistributedManager.{name} must be a bool (got {value!r})")
        changes: dict[str, Any] = {name: value}
        cls._state = attrs.evolve(cls._current(), **changes)

    def barrier(self) -> None:
        """Wait for every process of the job; a no-op in a single process."""
        group = self.process_group
        if group is not None:
            state = self._current()
            if backend_for(state.backend or "", "cuda") == "nccl":  # "nccl", or the CUDA half of "cpu:gloo,cuda:nccl"
                dist.barrier(group=group, device_ids=[state.device.index or 0])
            else:
                dist.barrier(group=group)

    def __repr__(self) -> str:
        state = self._current()
        return (
            f"DistributedManager(rank={state.rank}, local_rank={state.local_rank}, world_size={state.world_size}, "
            f"device={str(state.device)!r}, backend={state.backend!r}, initialized={state.initialized})"
        )


def dtensor_type() -> type[torch.Tensor] | None:
    """DTensor (FSDP's sharded tensors), when ``torch.distributed.tensor`` is loaded: without it no tensor is
    one, and asking imports nothing, so plain models pay nothing."""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None) if module is not None else None


def unwrap_model(module: torch.nn.Module) -> torch.nn.Module:
    """The module under data-parallel and ``torch.compile`` wrappers (itself when unwrapped).

    Checkpoints and averaged (EMA) weights are taken from the unwrapped module, so
    their keys carry no ``module.`` / ``_orig_mod.`` prefix and load into a plain model.
    """
    while True:
        if isinstance(module, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)):
            module = module.module
        elif _is_compiled(module):
            module = module._orig_mod  # type: ignore[assignment]
        else:
            return module


def _is_compiled(module: torch.nn.Module) -> bool:
    # Only torch.compile builds OptimizedModule; without torch._dynamo imported there is none
    # (and importing it just to check would cost seconds).
    if "torch._dynamo" not in sys.modules:
        return False
    return isinstance(module, sys.modules["torch._dynamo"].eval_frame.OptimizedModule)
