"""Which TransformerEngine recipe each harness format trains with on TE's FSDP2 route (`RECIPES`),
which formats that route does not offer and why (`NOT_ON_THIS_ROUTE`), and the recipe object
itself (`make_recipe`): what the route (route.py) and its model scenario (model.py) both need.
"""

from __future__ import annotations

__all__ = ["NOT_ON_THIS_ROUTE", "RECIPES", "make_recipe"]

#: format -> (recipe class name in transformer_engine.common.recipe, keyword arguments)
RECIPES: dict[str, tuple[str, dict]] = {
    "fp8_tensor": ("Float8CurrentScaling", {}),
    "fp8_block": ("Float8BlockScaling", {}),
    "mxfp8": ("MXFP8BlockScaling", {}),
    "nvfp4_2d": ("NVFP4BlockScaling", {"disable_2d_quantization": False}),
}

#: formats TE's FSDP2 route does not offer, with TE's reason
NOT_ON_THIS_ROUTE = {
    "fp8_tensor_e5m2": "TE's recipes quantize weights in E4M3 (\"Pure E5M2 training is not supported\")",
    "fp8_block_1x128": "TE's Float8BlockwiseQTensor.fsdp_pre_all_gather supports 2-D block scaling only "
                       "(Float8BlockScaling(w_block_scaling_dim=1) raises NotImplementedError)",
    "nvfp4_1d": "TE's NVFP4Tensor.fsdp_pre_all_gather needs 2-D weight quantization when training uses the "
                "columnwise copy (NVFP4BlockScaling(disable_2d_quantization=True) fails its assertion)",
}


def make_recipe(fmt: str, recipes: dict[str, tuple[str, dict]] = RECIPES):
    """TE's recipe object for `fmt` (transformer_engine.common.recipe), as `recipes` names it.

    Args:
        fmt: a harness format name, a key of `recipes`.
        recipes: format -> (recipe class name, keyword arguments); an adapter's own table
            (e.g. te:delayed's DelayedScaling).
    """
    from transformer_engine.common import recipe  # TE is optional: imported on use, never at import time

    name, kwargs = recipes[fmt]
    return getattr(recipe, name)(**kwargs)
