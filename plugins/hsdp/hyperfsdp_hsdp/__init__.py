"""HSDP and replicated parameters for hyperfsdp (entry point ``hsdp``)."""
