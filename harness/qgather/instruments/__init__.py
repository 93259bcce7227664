"""What a rank measures with, knowing no implementation: bit comparisons and digests of tensors
(compare) and every monkeypatch of torch.distributed or of the FSDP2 hooks as a named context
manager (patches). Below the adapters, so that a library's own route (TE's model scenario, torchao's
transport) uses the same instruments as the harness; qgather.check judges an implementation with them."""
