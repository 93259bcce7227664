"""An adapter that declares every format, scenario and device, and skips some cases for a reason of its
own: a SKIPPED that is the adapter's decision (an undeclared format or device is never collected)."""

from qgather.impls.reference import ReferenceImplementation


class SkipsUnevenShards(ReferenceImplementation):
    def skip_reason(self, spec, device):
        if spec.shape[0] % spec.world_size:
            return "this adapter leaves out uneven shards"
        return super().skip_reason(spec, device)


class SkipsEverything(ReferenceImplementation):
    def skip_reason(self, spec, device):
        return "this adapter's library is not installed here"
