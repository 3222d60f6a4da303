"""Weights shared with every worker actor of a node through Ray's object store, without copies.

``share(loaded) -> ObjectRef``: a LoadedModel put once per Ray instance (a later launch of the
same object reuses the ref) as a small pickle plus one byte array per tensor; an actor that
receives it gets the LoadedModel back with every tensor mapped from the store, not unpickled into a
copy. Contract: the workers treat the weights as read-only (one memory for every actor of the node;
tests/cluster/test_weights.py holds the store's copy bitwise equal to the driver's after serving).
A tensor referenced twice (tied embeddings) is stored once and comes back as one tensor.
"""

from __future__ import annotations

import io
import threading
import warnings
import weakref
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ray import ObjectRef

    from tandem.engine.loader import LoadedModel

_lock = threading.Lock()
_refs: dict[int, tuple[str, ObjectRef[Shared]]] = {}     # id(loaded) -> (Ray node id, ObjectRef), while loaded lives


class Shared:
    """``loaded`` as (pickle bytes, arrays); unpickling it builds the LoadedModel back."""

    def __init__(self, loaded: LoadedModel) -> None:
        from ray.cloudpickle import CloudPickler
        import torch

        arrays: list[Any] = []   # numpy uint8 views, one a tensor
        seen: dict[int, tuple[int, str, tuple[int, ...], bool, bool]] = {}

        class Pickler(CloudPickler):
            def persistent_id(self, obj: object) -> tuple[int, str, tuple[int, ...], bool, bool] | None:
                if not isinstance(obj, torch.Tensor):
                    return None
                if id(obj) not in seen:
                    flat = obj.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
                    arrays.append(flat.numpy())
                    seen[id(obj)] = (len(arrays) - 1, str(obj.dtype).removeprefix("torch."), tuple(obj.shape),
                                     isinstance(obj, torch.nn.Parameter), obj.requires_grad)
                return seen[id(obj)]

        buf = io.BytesIO()
        Pickler(buf, protocol=5).dump(loaded)  # type: ignore[no-untyped-call]  # Ray's CloudPickler is unannotated
        self.data, self.arrays = buf.getvalue(), arrays

    def __reduce__(self) -> tuple[Any, tuple[bytes, list[Any]]]:
        return _rebuild, (self.data, self.arrays)


def _rebuild(data: bytes, arrays: list[Any]) -> LoadedModel:
    import pickle

    import torch

    built: dict[int, torch.Tensor] = {}

    class Unpickler(pickle.Unpickler):
        def persistent_load(self, pid: tuple[int, str, tuple[int, ...], bool, bool]) -> torch.Tensor:
            i, dtype, shape, param, grad = pid
            if i not in built:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", UserWarning)    # the store's buffer is read-only
                    t = torch.from_numpy(arrays[i]).view(getattr(torch, dtype)).reshape(shape)
                built[i] = torch.nn.Parameter(t, requires_grad=grad) if param else t
            return built[i]

    loaded: LoadedModel = Unpickler(io.BytesIO(data)).load()
    return loaded


def share(loaded: LoadedModel) -> ObjectRef[Shared]:
    """An ObjectRef of ``loaded`` whose tensors the workers map read-only from the object store;
    the same ref for the same object within one Ray instance."""
    import ray

    node = ray.get_runtime_context().get_node_id()
    with _lock:
        held = _refs.get(id(loaded))
        if held is not None and held[0] == node:
            return held[1]
        ref = ray.put(Shared(loaded))
        if id(loaded) not in _refs:
            weakref.finalize(loaded, _refs.pop, id(loaded), None)
        _refs[id(loaded)] = (node, ref)
        return ref
