"""The suite: sweeps of cases, the shapes they use, covering designs and coverage."""
