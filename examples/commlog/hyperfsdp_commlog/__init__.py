"""hyperfsdp-commlog: an example third-party hyperfsdp plugin (see docs/plugins.md)."""
