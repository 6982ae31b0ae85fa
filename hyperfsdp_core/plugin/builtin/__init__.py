"""Plugins that ship with the core and are always registered (``hyperfsdp.core``,
``hyperfsdp.mixed_precision``). They are written like any third-party plugin, on the public
plugin API (``hyperfsdp_core.plugin``) only; ``tests/test_public_api.py`` checks it."""
