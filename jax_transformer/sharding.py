"""Data parallelism over a device mesh: pmap semantics written as `jax.jit` with shardings.

A 1-D `Mesh` with one axis, `data`, spans the devices. Batches are sharded along their first
axis over it; the training state (parameters, optimizer state, step) is replicated. Under
`jax.jit` the loss is a mean over the global batch, so XLA inserts the all-reduce of the
gradients that `pmap` + `lax.pmean` would spell out by hand; every device then applies the same
update to its replica. (`jax.pmap` itself is in maintenance mode and, since JAX 0.8, built on
`jit` + `shard_map`.)

Multi-host: call `initialize_distributed` before anything touches a device; each process then
loads its own slice of every global batch and `shard_batch` assembles the global array with
`jax.make_array_from_process_local_data`.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

DATA_AXIS = "data"


def initialize_distributed(
    coordinator_address: str | None = None, num_processes: int | None = None, process_id: int | None = None
) -> None:
    """`jax.distributed.initialize` from arguments, or from JAX_COORDINATOR_ADDRESS /
    JAX_NUM_PROCESSES / JAX_PROCESS_ID; a no-op for a single process. Call it first."""
    coordinator_address = coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS")
    if num_processes is None and "JAX_NUM_PROCESSES" in os.environ:
        num_processes = int(os.environ["JAX_NUM_PROCESSES"])
    if process_id is None and "JAX_PROCESS_ID" in os.environ:
        process_id = int(os.environ["JAX_PROCESS_ID"])
    if coordinator_address is None and num_processes in (None, 1):
        return
    jax.distributed.initialize(coordinator_address, num_processes=num_processes, process_id=process_id)


def make_mesh(num_devices: int | None = None) -> Mesh:
    """A 1-D mesh named `data` over the first `num_devices` devices (all of them by default).

    With several processes every device takes part (each process contributes its local ones).
    """
    devices = jax.devices()
    if num_devices is not None:
        if not 1 <= num_devices <= len(devices):
            raise ValueError(f"--devices {num_devices}: this machine has {len(devices)} device(s)")
        if jax.process_count() > 1 and num_devices != len(devices):
            raise ValueError("with several processes, every device takes part: leave --devices unset")
        devices = devices[:num_devices]
    return Mesh(np.array(devices), (DATA_AXIS,))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def batch_sharded(mesh: Mesh) -> NamedSharding:
    """The first axis split over `data`, the rest whole."""
    return NamedSharding(mesh, P(DATA_AXIS))


def replicate(tree: Any, mesh: Mesh) -> Any:
    """Place every array of `tree` whole on every device of `mesh`."""
    return jax.device_put(tree, replicated(mesh))


def process_slice(global_rows: int) -> slice:
    """The rows of a global batch this process loads (all of them with one process)."""
    if global_rows % jax.process_count():
        raise ValueError(f"a global batch of {global_rows} rows cannot be split over {jax.process_count()} processes")
    per_process = global_rows // jax.process_count()
    return slice(jax.process_index() * per_process, (jax.process_index() + 1) * per_process)


def shard_batch(batch: dict[str, np.ndarray], mesh: Mesh) -> dict[str, jax.Array]:
    """Process-local rows -> global arrays sharded along `data`.

    With one process the local rows are the global batch; with several, each passes its own
    slice (see `process_slice`) and the global batch is their concatenation in process order.
    """
    devices = mesh.devices.size
    sharding = batch_sharded(mesh)
    out = {}
    for name, local in batch.items():
        rows = local.shape[0] * jax.process_count()
        if rows % devices:
            raise ValueError(
                f"a global batch of {rows} rows cannot be split evenly over {devices} devices; "
                f"make the batch size a multiple of {devices}"
            )
        out[name] = jax.make_array_from_process_local_data(sharding, local)
    return out
