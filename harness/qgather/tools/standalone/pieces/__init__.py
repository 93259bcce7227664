"""The code a standalone reproduction script is made of (`qgather repro ID --standalone`).

Every module here imports only torch and the standard library at module level, and each function
is copied into the script verbatim (`inspect.getsource`): what the tests import and check here is
exactly what a maintainer runs. Library imports (torchao, TransformerEngine) sit inside the route
functions that need them. Names the script defines at its top (SHAPE, SEED, DTYPE, WORLD_SIZE, TP,
TIMEOUT_S, LIBRARY_NEEDS_CUDA) are read as globals by `launch` and the routes.
"""
