"""Data parallelism over a 1-D mesh, axis `data`, replicated or FSDP (docs/operations.md#devices-and-processes)."""

from __future__ import annotations

import os
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from torch_reference.config import SettingError

DATA_AXIS = "data"
LAYOUTS = ("replicated", "fsdp")  # the training state's layouts over the mesh
ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID = "JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"


def initialize_distributed(coordinator_address: str | None = None, num_processes: int | None = None,
                           process_id: int | None = None) -> None:
    """`jax.distributed.initialize` from the arguments or JAX_* variables, once, before anything touches a device."""
    coordinator_address = coordinator_address or os.environ.get(ENV_COORDINATOR)
    if num_processes is None and os.environ.get(ENV_NUM_PROCESSES):
        num_processes = int(os.environ[ENV_NUM_PROCESSES])
    if process_id is None and os.environ.get(ENV_PROCESS_ID):
        process_id = int(os.environ[ENV_PROCESS_ID])
    if (coordinator_address is None and num_processes in (None, 1)) or jax.distributed.is_initialized():
        return
    if num_processes is None or process_id is None or coordinator_address is None:
        raise SettingError("a multi-process run needs the coordinator address, the number of processes and this "
                           "process's id ({}/{}/{} or {env}); got {got}", "coordinator_address", "num_processes",
                           "process_id", env=f"{ENV_COORDINATOR}/{ENV_NUM_PROCESSES}/{ENV_PROCESS_ID}",
                           got=f"{coordinator_address!r}, {num_processes!r}, {process_id!r}")
    if not 0 <= process_id < num_processes:
        raise ValueError(f"process id {process_id} is not in 0..{num_processes - 1}")
    jax.distributed.initialize(coordinator_address, num_processes=num_processes, process_id=process_id)


def make_mesh(num_devices: int | None = None) -> Mesh:
    """A 1-D mesh named `data` over the first `num_devices` devices (every process's devices by default)."""
    devices = jax.devices()
    if num_devices is not None:
        if not 1 <= num_devices <= len(devices):
            raise SettingError("{} {n}: {visible} device(s) visible ({platform})", "devices", n=num_devices,
                               visible=len(devices), platform=devices[0].platform)
        if jax.process_count() > 1 and num_devices != len(devices):
            raise SettingError("{} {n}: with {processes} processes every one of the {visible} devices takes part; "
                               "leave {} unset (or limit each process's devices through its platform)", "devices",
                               "devices", n=num_devices, processes=jax.process_count(), visible=len(devices))
        devices = devices[:num_devices]
    return Mesh(np.array(devices), (DATA_AXIS,))


def replicated(mesh: Mesh) -> NamedSharding:
    """Whole on every device of `mesh`."""
    return NamedSharding(mesh, P())


def batch_sharded(mesh: Mesh) -> NamedSharding:
    """The first axis split over `data`, the rest whole."""
    return NamedSharding(mesh, P(DATA_AXIS))


def fsdp_spec(shape: tuple[int, ...], num_devices: int) -> P:
    """`data` on the largest dimension of `shape` divisible by `num_devices`, the rest whole; else P() (replicated)."""
    if num_devices > 1:
        for dim in sorted(range(len(shape)), key=lambda d: (-shape[d], d)):
            if shape[dim] % num_devices == 0:
                return P(*[DATA_AXIS if d == dim else None for d in range(len(shape))])
    return P()


def state_shardings(tree: Any, mesh: Mesh, layout: str = "replicated") -> Any:
    """A `NamedSharding` for every array of `tree`: `replicated`, or split per `fsdp_spec` (`fsdp`)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r} is not one of {', '.join(LAYOUTS)}")
    if layout == "replicated":
        return jax.tree.map(lambda _: replicated(mesh), tree)
    return jax.tree.map(lambda x: NamedSharding(mesh, fsdp_spec(np.shape(x), mesh.devices.size)), tree)


def place(tree: Any, shardings: Any) -> Any:
    """Every array of `tree` (host values, the same in every process) placed with `shardings`, slice by slice."""

    def put(x, sharding):
        if jax.dtypes.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key):
            data = put(jax.random.key_data(x), sharding)
            impl = jax.random.key_impl(x)
            return jax.jit(lambda d: jax.random.wrap_key_data(d, impl=impl), out_shardings=sharding)(data)
        if jax.process_count() == 1:
            # A copy owned by the runtime: an aliased host buffer cannot be donated (the first update would hold two).
            return jax.device_put(x, sharding, may_alias=False)
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    if isinstance(shardings, jax.sharding.Sharding):
        return jax.tree.map(lambda x: put(x, shardings), tree)
    return jax.tree.map(put, tree, shardings)


def gather(tree: Any, mesh: Mesh) -> Any:
    """`tree` replicated over `mesh`: sharded arrays all-gathered (every process must call it alike)."""
    leaves, treedef = jax.tree.flatten(tree)
    split = [i for i, x in enumerate(leaves) if not x.is_fully_replicated]
    if split:
        whole = jax.jit(lambda xs: xs, out_shardings=replicated(mesh))([leaves[i] for i in split])
        for i, x in zip(split, whole):
            leaves[i] = x
    return jax.tree.unflatten(treedef, leaves)


def local_copy(tree: Any) -> Any:
    """This process's copy of every replicated array of `tree` on its first local device (no data moves)."""

    if unreplicated := [x.sharding for x in jax.tree.leaves(tree) if not x.is_fully_replicated]:
        raise ValueError(f"local_copy needs replicated arrays, got sharding {unreplicated[0]}")
    return jax.tree.map(lambda x: x.addressable_data(0), tree)


def process_slice(global_rows: int) -> slice:
    """The rows of a global batch this process loads (all of them with one process)."""
    count, index = jax.process_count(), jax.process_index()
    if global_rows % count:
        raise ValueError(f"a global batch of {global_rows} rows cannot be split over {count} processes")
    per_process = global_rows // count
    return slice(index * per_process, (index + 1) * per_process)


def shard_batch(batch: dict[str, np.ndarray], mesh: Mesh) -> dict[str, jax.Array]:
    """Process-local rows -> global arrays sharded along `data`, concatenated in process order."""
    devices = mesh.devices.size
    sharding = batch_sharded(mesh)
    out = {}
    for name, local in batch.items():
        rows = local.shape[0] * jax.process_count()
        if rows % devices:
            raise ValueError(f"a global batch of {rows} rows cannot be split evenly over {devices} devices; "
                             f"make the batch size a multiple of {devices}")
        out[name] = jax.make_array_from_process_local_data(sharding, local, (rows, *local.shape[1:]))
    return out
