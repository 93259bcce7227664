"""Library noise filtered to what a user needs: torchao's warnings about kernel libraries it cannot
load (one per library, about 220 lines a run) become one line, in the runner and in every rank;
torch's performance hint on every precomputed float8 scale over a ("dp", "tp") mesh is dropped."""

from __future__ import annotations

import logging


class _TorchaoLibraryFilter(logging.Filter):
    """torchao warns once per optional kernel library it cannot load (CUDA builds on a CPU host):
    keep the first as one summary line, drop the rest."""

    def __init__(self, summary: bool = True) -> None:
        super().__init__()
        self.dropped = 0 if summary else 1  # a rank: the runner already printed the summary line

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith("Failed to load "):
            return True
        self.dropped += 1
        if self.dropped == 1:
            record.msg = "torchao: optional kernel libraries not loadable here (e.g. CUDA-only builds); warnings hidden"
            record.args = ()
            return True
        return False


def quiet_torchao(summary: bool = True) -> None:
    """Filter torchao's library-loading warnings to one line, or to none (`summary=False`, in the
    rank processes); idempotent."""
    logger = logging.getLogger("torchao")
    if not any(isinstance(f, _TorchaoLibraryFilter) for f in logger.filters):
        logger.addFilter(_TorchaoLibraryFilter(summary))
    pytree = logging.getLogger("torch.utils._pytree")
    if not any(isinstance(f, _EnumConstantFilter) for f in pytree.filters):
        pytree.addFilter(_EnumConstantFilter())
    redistribute = logging.getLogger("torch.distributed.tensor._redistribute")
    if not any(isinstance(f, _SequentialMaxFilter) for f in redistribute.filters):
        redistribute.addFilter(_SequentialMaxFilter())


class _EnumConstantFilter(logging.Filter):
    """torch deprecates register_constant() on Enums, which torchao still calls at import: noise here."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "register_constant() on Enum subclasses" not in record.getMessage()


class _SequentialMaxFilter(logging.Filter):
    """torchao's precomputed scale all-reduces a max over both dimensions of a ("dp", "tp") mesh, and
    torch warns on every rank, at every step, that two sequential all-reduces are slower than one
    over a flattened mesh: a performance hint (a max is the same in any order), noise here."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not ("Partial(max)" in message and "sequential all_reduce" in message)
