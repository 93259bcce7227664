"""What each rank does with the implementation's quantized weight in each scenario, one scenario per
module, dispatched by name from `registry` (`registry.run_on_rank` on the pool's ranks,
`virtual.run_virtual` in one process).

- `registry`: scenario name -> runner, checked against qgather.model.case.SCENARIOS at import
- `context`: `RankCase`, one case on one rank (what every step reads)
- `fsdp`: gather, steps and reshard under `fully_shard`; `hooks`: the hooks without it;
  `virtual`: every rank emulated in one process; `model` runs the adapter's own `run_model`
- `data` (weights, gradients, inputs), `module` (the module under FSDP2), `fsdp_setup` (a
  configuration as fully_shard kwargs), `emulation` (FSDP2's chunking and hook conventions),
  `checkpoint` (dcp-wsA on the ranks), `compiled` (torch.compile)

What a rank measures of a gathered weight (golden, inspection, wire) is qgather.check.
"""
