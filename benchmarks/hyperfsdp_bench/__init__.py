"""hyperfsdp's side-by-side benchmark suite (hyperfsdp vs FSDP2 vs DDP vs a compute-only floor).

Run it with ``hyperfsdp bench`` (or ``python -m hyperfsdp_bench``); see ``benchmarks/README.md``.
It is its own distribution (``hyperfsdp-bench``, ``pip install -e benchmarks``) that adds the
command through the plugin hook ``hyperfsdp_cli_commands`` (:mod:`.plugin`); the core never
imports it.
"""
