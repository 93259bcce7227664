"""The torchao float8 adapter and the gloo transport shim it needs."""
