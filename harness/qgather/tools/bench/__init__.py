"""qgather's benchmarks, in a room of their own: each prints ratios measured in one run.

    case_bench       one large case against its bare work (`qgather bench gpu`), its steps (bench_steps)
                     and their report (bench_report); case_profile, peak_anatomy and memory_waypoints
                     say where its time and memory go
    format_bench     the formats' quantize/dequantize against their HBM floor
    nccl_projection  NCCL's time projected from one GPU
    list_bench       `qgather list` on a large selection
    suite_bench      the suite's pytest time
"""
