"""``python benchmarks/run.py [options]``: the same as ``hyperfsdp bench [options]``."""

if __name__ == "__main__":
    import sys
    import warnings

    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    from hyperfsdp_bench.cli import main

    sys.exit(main())
