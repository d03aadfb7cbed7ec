"""SGLang's update method names (and ours), as one table of adapters over ``update``.

Each row of ``METHODS`` is a method name, the source it builds and its parameters in
order (the source's fields and ``UpdateOptions``' fields, in the order SGLang's method
takes them, so positional calls keep working). ``UpdateMethods`` gets one method per row,
with that signature and a docstring from the row and the source: each builds the source
and the options from its arguments and calls ``self.update(source, options)``. Nothing
else happens in an adapter: every rule lives in the transaction (``update/updater.py``),
the source (``update/sources/``) or the writer (``update/writers.py``).

``Engine`` gets them (``with_update_methods``), and so ``TPEngine`` (whose ``update``
reaches every rank); the HTTP server builds the same sources from its requests.
"""
from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass

from course_lib.update.records import UpdateOptions
from course_lib.update.sources import (BroadcastSource, DeltaSource, DiskSource, RegisteredSource, RemoteSource,
                                       ReshardSource, SnapshotSource, SparseSource, TensorSource)


@dataclass(frozen=True)
class Method:
    """One adapter: ``name(params...)`` builds ``source`` and ``UpdateOptions``, then updates."""
    name: str
    source: type
    params: str   # space-separated, in the method's order
    doc: str      # what the method does, in one sentence

    def _fields(self, cls) -> dict:
        return {f.name: f for f in dataclasses.fields(cls) if f.init}

    def signature(self) -> inspect.Signature:
        sources, options = self._fields(self.source), self._fields(UpdateOptions)
        params = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
        for name in self.params.split():
            f = sources.get(name) or options[name]
            default = inspect.Parameter.empty if f.default is dataclasses.MISSING else f.default
            params.append(inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=default))
        return inspect.Signature(params)

    def adapter(self):
        """The method: arguments bound by name (as the signature says), split between the
        source and the options. Bound by hand, not with ``Signature.bind``: an adapter runs
        on every update, and binding costs more than a small update's own host work."""
        signature, source_names = self.signature(), set(self._fields(self.source))
        names = self.params.split()
        allowed = frozenset(names)
        required = [p.name for p in list(signature.parameters.values())[1:] if p.default is inspect.Parameter.empty]
        row = self

        def method(engine, *args, **kwargs):
            if len(args) > len(names):
                raise TypeError(f"{row.name}() takes {len(names)} arguments after self ({len(args)} given)")
            given = dict(zip(names, args))
            for key, value in kwargs.items():
                if key in given:
                    raise TypeError(f"{row.name}() got multiple values for argument {key!r}")
                if key not in allowed:
                    raise TypeError(f"{row.name}() got an unexpected keyword argument {key!r}")
                given[key] = value
            missing = [name for name in required if name not in given]
            if missing:
                raise TypeError(f"{row.name}() missing required arguments: {', '.join(map(repr, missing))}")
            source = row.source(**{k: v for k, v in given.items() if k in source_names})
            return engine.update(source, UpdateOptions(**{k: v for k, v in given.items() if k not in source_names}))
        method.__name__ = method.__qualname__ = self.name
        method.__signature__ = signature
        method.__doc__ = (f"{self.doc}\n\nBuilds ``{self.source.__name__}`` from the arguments and runs "
                          f"``update(source, UpdateOptions(...))``.\n\n{self.source.__name__}: "
                          f"{inspect.getdoc(self.source)}")
        return method


COMMON = "flush_cache weight_version abort_all_requests wait_timeout_s"

METHODS = (
    Method("update_weights_from_disk", DiskSource,
           "model_path weight_version flush_cache abort_all_requests partial staging keep_snapshot wait_timeout_s pause_mode resume",
           "Load new weights from a Hugging Face checkpoint directory, in place, between two steps."),
    Method("update_weights_from_tensor", TensorSource,
           "named_tensors load_format flush_cache weight_version abort_all_requests check_finite wait_timeout_s pause_mode resume",
           "Load tensors handed over in memory (a co-located trainer), in place."),
    Method("update_weights_from_registered", RegisteredSource,
           "buckets epoch weight_version flush_cache abort_all_requests wait_timeout_s pause_mode resume",
           "Copy registered buckets (bucket numbers the trainer has written) into the weights, as one update."),
    Method("update_weights_from_distributed", BroadcastSource,
           "names dtypes shapes group_name flush_cache weight_version load_format abort_all_requests check_finite "
           "wait_timeout_s refuse_with pause_mode resume",
           "Receive tensors the trainer broadcasts (rank 0 of the group) and load them in place."),
    Method("update_weights_resharded", ReshardSource,
           "plan group_name weight_version flush_cache abort_all_requests refuse_with trainer_group_ranks "
           "engine_group_ranks wait_timeout_s pause_mode resume",
           "Receive this rank's pieces of a trainer's tensor-parallel layout and load them."),
    Method("update_weights_sparse", SparseSource, f"payload {COMMON} pause_mode resume",
           "Apply a sparse payload: only changed elements, in checkpoint coordinates."),
    Method("update_weights_from_delta", DeltaSource,
           "base_dir delta_path weight_version base_version flush_cache abort_all_requests staging keep_snapshot "
           "tmp_dir wait_timeout_s pause_mode resume",
           "Rebuild a checkpoint from a base on shared disk plus a byte delta, and load it."),
    Method("receive_weights_from_remote", RemoteSource,
           "master_address master_port group_name backend weight_version timeout_s pause_mode resume",
           "Join a serving engine's seeding group, receive every weight, load them and become ready."),
    Method("rollback", SnapshotSource, "flush_cache abort_all_requests pause_mode resume",
           "Restore the host snapshot (bitwise the old weights, version and runtime config), in place."),
)


def with_update_methods(cls):
    """Class decorator: add one adapter per row of ``METHODS`` to ``cls`` (which has ``update``)."""
    for row in METHODS:
        setattr(cls, row.name, row.adapter())
    return cls
