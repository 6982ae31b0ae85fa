"""``python benchmarks/profile_step.py``: cProfile hyperfsdp vs FSDP2 on one rank (see profiling.py)."""

if __name__ == "__main__":
    import sys
    import warnings
    from pathlib import Path

    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from hyperfsdp_bench.profiling import main

    sys.exit(main())
