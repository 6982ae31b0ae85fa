"""The suite's configuration and implementation names, with no imports: ``hyperfsdp bench``
builds its command line from these before anything heavier of the suite is imported."""

#: the model configurations, and the host-overhead one (tiny blocks, its own report)
MODEL_CONFIGS = (
    "even",
    "uneven",
    "bf16",
    "no-reshard",
    "hsdp",
    "tp",
    "tp-shm",
    "param-heavy",
    "offload",
)
HOST_OVERHEAD = "host-overhead"
#: the main implementations
IMPLS = ("hyperfsdp", "fsdp2", "ddp", "floor")
#: opt-in variants (``--impl``; see ``impls``)
VARIANTS = (
    "hyperfsdp-tuned",
    "hyperfsdp-native",
    "hyperfsdp-core",
    "hyperfsdp-foreach",
    "fsdp2-foreach",
    "ddp-foreach",
    "floor-foreach",
)
#: what the ``offload`` configuration runs beside its main implementations
OFFLOAD_VARIANTS = ("hyperfsdp-no-offload", "fsdp2-unpinned", "fsdp2-no-offload")
