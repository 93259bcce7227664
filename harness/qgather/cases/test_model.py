"""A small model of the library's own layers trained sharded, against the same model on one device
(TE: LayerNormLinear, LayerNormMLP, TransformerLayer; qgather.impls.te.model). Shapes read
`hidden x ffn`: 128x352 has shards misaligned with NVFP4's 16 rows at 4 ranks and with the
blockwise 128-row tiles at 2; 256x512 aligns both at 2 ranks. Implementations without layers of
their own skip it."""

from qgather.suite.sweeps import Sweep

MODEL_FORMATS = ("fp8_tensor", "fp8_block", "mxfp8", "nvfp4_2d")
SWEEP = Sweep(scenarios=("model",), dtypes=("bf16",), world_sizes=(1, 2, 4), formats=MODEL_FORMATS,
              shapes=lambda fmt: [(128, 352), (256, 512)])


def test_model(case, qgather):
    qgather.check(case)
