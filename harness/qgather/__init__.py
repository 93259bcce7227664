"""qgather: a distributed correctness harness for quantized weight all-gather under FSDP2."""

__version__ = "0.1.0"
