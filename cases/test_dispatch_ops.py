"""The ops FSDP2 applies to a parameter, one by one, on each implementation's quantized weight.

Defined in qgather.cases.test_dispatch_ops, so that an installed qgather carries it."""

# Names in definition order (not sorted): pytest runs a module's tests in the order it holds them.
from qgather.cases.test_dispatch_ops import (  # noqa: F401, I001 - pytest collects them (and the hook) here
    pytest_generate_tests,
    quantized,
    test_chunk,
    test_slice_and_narrow,
    test_as_strided_with_offset,
    test_view_and_detach,
    test_new_zeros_then_copy,
    test_strided_slice_is_exact_or_refused,
)
