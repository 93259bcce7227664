"""The code a standalone reproduction script is made of (`qgather repro ID --standalone`).

Every module here imports only torch and the standard library at module level, and each function
is copied into the script (`inspect.getsource`, docstrings dropped, each `if` on the case's constants
decided: qgather.tools.standalone.specialize), so what a maintainer runs is what the tests check here,
less the branches its case does not take. Library imports (torchao, TransformerEngine) sit inside the
route functions that need them. Names the script defines at its top (CASE, SHAPE, SEED, DTYPE,
WORLD_SIZE, TIMEOUT_S and the template's own constants) are read as globals by `launch` and the routes.
"""
