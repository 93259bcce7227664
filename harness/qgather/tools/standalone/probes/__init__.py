"""Probes: the standalone scripts of findings that are not a qgather case (a one-GPU state leak, a
memory measurement, an optimizer's cached transpose). Each module here is a whole script, copied
as it is to docs/repro/<name>.py by `make repro-docs` (qgather.tools.standalone.docs); none is
imported. Each exits 1 with its evidence while the defect is there, 0 once it is fixed, and says
HANG itself at its deadline (REPRO_TIMEOUT_S, default 30 s, from after its imports)."""
