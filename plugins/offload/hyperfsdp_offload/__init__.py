"""CPU offload for hyperfsdp (entry point ``offload``)."""
