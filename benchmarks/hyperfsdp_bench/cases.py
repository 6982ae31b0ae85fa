"""The benchmark matrix: configurations, world sizes, depths, and the quick/full presets."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import attrs

from .impls import ALL_IMPLS, CaseSpec, parse_impl
from .model import ModelConfig
from .names import HOST_OVERHEAD, MODEL_CONFIGS

#: Model configurations (``--config``). Dims: ~11M parameters at 8 layers.
CONFIGS = {
    "even": "dims divisible by every world size, fp32",
    "uneven": "vocab 8193 and MLP hidden 705 (not divisible by the world size), fp32",
    "bf16": "bf16 compute, fp32 reduce (MixedPrecisionPolicy; the floor the same casts, DDP autocast)",
    "no-reshard": "reshard_after_forward=False, fp32",
    "hsdp": "HSDP on a (2, world/2) (replicate, shard) mesh, fp32 (hyperfsdp needs hyperfsdp-hsdp)",
    "tp": "TP + FSDP: (world/2, 2) (dp, tp) mesh, Colwise/Rowwise + sequence parallel, FSDP over dp, fp32 (hyperfsdp needs hyperfsdp-tp)",
    "tp-shm": "tp with the tp mesh dimension on the hyperfsdp_shm c10d backend (shared-memory "
    "all-gathers and reduce-scatters; register_shm_backend) for both FSDPs",
    "param-heavy": "dim 1024, 16 heads, MLP hidden 2816, batch 1 x 64 tokens: parameters, "
    "gradients and optimizer state outweigh activations (~120M parameters at 8 layers), fp32",
    "offload": "CPUOffloadPolicy() for both FSDPs, fp32; also hyperfsdp and FSDP2 without "
    "offload and FSDP2 with CPUOffloadPolicy(pin_memory=False) (hyperfsdp needs hyperfsdp-offload)",
    "host-overhead": "64 tiny blocks (dim 32): per-unit host cost, compute negligible",
}
#: host overhead: no DDP (the floor is the reference); any variant of the others
HOST_OVERHEAD_BASES = ("hyperfsdp", "fsdp2", "floor")
#: the tensor-parallel configurations (the tp group on gloo, and on hyperfsdp_shm)
TP_CONFIGS = ("tp", "tp-shm")
#: tensor parallelism: the two FSDPs and the floor (the same TP model without FSDP: each
#: data-parallel replica trains on its own, only the "tp" collectives run); no DDP
TP_BASES = ("hyperfsdp", "fsdp2", "floor")
#: the offload configuration also runs these, whenever their main implementation runs
OFFLOAD_EXTRAS = {
    "hyperfsdp": ("hyperfsdp-no-offload",),
    "fsdp2": ("fsdp2-unpinned", "fsdp2-no-offload"),
}

_EVEN = {"vocab": 8192, "dim": 256, "n_heads": 4, "hidden": 704, "seq_len": 128, "batch": 4}
_UNEVEN = {**_EVEN, "vocab": 8193, "hidden": 705}
_TINY = {"vocab": 128, "dim": 32, "n_heads": 2, "hidden": 64, "seq_len": 16, "batch": 2}
#: parameter-dominated: 16 heads of 64 (the other configs' head size), SwiGLU hidden
#: 8/3 * dim rounded up to a multiple of 256 (the Llama rule); ~120M parameters at 8 layers
#: (480 MB fp32; with gradients and AdamW state 1.9 GB unsharded) against ~5 MB of
#: activations per block
_PARAM_HEAVY = {
    "vocab": 8192,
    "dim": 1024,
    "n_heads": 16,
    "hidden": 2816,
    "seq_len": 64,
    "batch": 1,
}


@attrs.frozen
class Case:
    config: str
    world: int
    layers: int

    @property
    def name(self) -> str:
        return f"{self.config} w{self.world} L{self.layers}"

    @property
    def key(self) -> str:
        return f"{self.config}-w{self.world}-l{self.layers}"

    @property
    def is_host_overhead(self) -> bool:
        return self.config == HOST_OVERHEAD

    def spec(self) -> CaseSpec:
        dims = {"uneven": _UNEVEN, HOST_OVERHEAD: _TINY, "param-heavy": _PARAM_HEAVY}.get(
            self.config, _EVEN
        )
        model = ModelConfig(n_layers=self.layers, **dims)
        return CaseSpec(
            model=model,
            precision="bf16" if self.config == "bf16" else "fp32",
            reshard_after_forward=False if self.config == "no-reshard" else None,
            hsdp=(2, self.world // 2) if self.config == "hsdp" else None,
            tp=2 if self.config in TP_CONFIGS else None,
            tp_backend="hyperfsdp_shm" if self.config == "tp-shm" else None,
            offload=self.config == "offload",
        )

    def impls(self, selected: Sequence[str]) -> tuple[str, ...]:
        """The implementations this case runs, of ``selected``, in a fixed order."""
        chosen = set(selected)
        if self.config == "offload":
            for impl in selected:
                chosen.update(OFFLOAD_EXTRAS.get(impl, ()))
        out = []
        for impl in ALL_IMPLS:
            if impl not in chosen:
                continue
            base, variant = parse_impl(impl)
            if variant in ("no-offload", "unpinned") and self.config != "offload":
                continue
            if self.is_host_overhead and base not in HOST_OVERHEAD_BASES:
                continue
            if self.config in TP_CONFIGS and base not in TP_BASES:
                continue
            out.append(impl)
        return tuple(out)


QUICK = (
    Case("even", 2, 8),
    Case("uneven", 2, 8),
    Case("bf16", 2, 8),
    Case("no-reshard", 2, 8),
    Case("even", 4, 8),
    Case("hsdp", 4, 8),
    Case("tp", 4, 8),
    Case("tp-shm", 4, 8),
    Case("even", 2, 4),
    Case("even", 2, 16),
    Case("param-heavy", 2, 8),
    Case("offload", 2, 8),
    Case(HOST_OVERHEAD, 1, 64),
    Case(HOST_OVERHEAD, 2, 64),
)
FULL = (
    *(
        Case(c, w, n)
        for c, w, n in itertools.product(MODEL_CONFIGS, (2, 4), (4, 8, 16))
        # HSDP needs replicate and shard groups of 2+; TP + FSDP needs dp and tp of 2+
        if not (c in ("hsdp", *TP_CONFIGS) and w < 4)
        # param-heavy: 120M parameters at 8 layers; one depth, world 2 and 4
        and not (c == "param-heavy" and n != 8)
    ),
    Case(HOST_OVERHEAD, 1, 64),
    Case(HOST_OVERHEAD, 2, 64),
)


@attrs.frozen
class Preset:
    name: str
    cases: tuple[Case, ...]
    steps: int  # timed steps per implementation, split over the rounds
    rounds: int
    warmup: int


#: the scaling charts: even at world 2 and 4, 8, 16, 32 layers; 8 layers at world 1, 2, 4
SCALING = (
    *(Case("even", 2, n) for n in (4, 8, 16, 32)),
    Case("even", 1, 8),
    Case("even", 4, 8),
)

PRESETS = {
    "quick": Preset("quick", QUICK, steps=12, rounds=3, warmup=3),
    "full": Preset("full", FULL, steps=30, rounds=5, warmup=3),
    "scaling": Preset("scaling", SCALING, steps=18, rounds=3, warmup=3),
}


def select_cases(
    preset: Preset,
    configs: Sequence[str] | None,
    worlds: Sequence[int] | None,
    layers: Sequence[int] | None,
) -> list[Case]:
    """The preset's cases that match every selector, plus the product of the selectors.

    Without selectors: the preset's cases. ``--world-size``/``--layers`` alone filter
    the preset. With ``--config``, every combination of the given configs, world
    sizes and depths also runs, the ones left out taking the main values (world 2,
    8 layers; host-overhead: worlds 1 and 2, 64 blocks): ``--config uneven
    --world-size 4`` runs ``uneven w4 L8`` even though the quick preset lacks it.
    """
    if not (configs or worlds or layers):
        return list(preset.cases)

    def keep(c: Case) -> bool:
        return (
            (not configs or c.config in configs)
            and (not worlds or c.world in worlds)
            and (not layers or c.layers in layers)
        )

    chosen = [c for c in preset.cases if keep(c)]
    for config in configs or ():
        host = config == HOST_OVERHEAD
        for w, n in itertools.product(
            worlds or ((1, 2) if host else (2,)), (64,) if host else (layers or (8,))
        ):
            chosen.append(Case(config, w, n))
    return list(dict.fromkeys(chosen))
