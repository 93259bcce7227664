"""A library's tensor subclass and its qgather adapter (README, "Testing your own tensor subclass")."""
