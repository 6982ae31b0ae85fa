"""hyperfsdp's side-by-side benchmark suite (hyperfsdp vs FSDP2 vs DDP vs a compute-only floor).

Run it with ``hyperfsdp bench`` (or ``python benchmarks/run.py``); see ``benchmarks/README.md``.
Nothing here is imported by the engine: this package lives in the checkout only.
"""
