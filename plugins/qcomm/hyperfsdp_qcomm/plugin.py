"""The qcomm plugin: a quantizing :class:`~hyperfsdp_core.plugin.Transport` per opted-in unit.

``hyperfsdp_transport(unit)`` returns a :class:`QuantizedTransport` for a unit whose modules
carry a :class:`~hyperfsdp_qcomm.QCommPolicy` (``hyperfsdp_qcomm.enable``), else ``None``
(the core's default). Written against ``hyperfsdp_core.plugin`` only.

- All-gather (``"int8"``, ZeRO++ qwZ style): this rank's shard is block-quantized
  (``_quant``), the packed ``uint8`` rows (int8 values + fp32 scales) are all-gathered in one
  collective, and every row, this rank's included, is dequantized into the rank-major
  output: every rank sees bit-identical unsharded parameters. ``"bf16"``: the shard is cast
  to bf16, gathered, and cast back.
- Reduce-scatter (qgZ style): each rank quantizes each destination's chunk of its gradient
  input (``"int8"``: blocks within the chunk; ``"bf16"``: a cast), one ``all_to_all_single``
  sends chunk ``j`` to rank ``j``, and each rank dequantizes the ``world`` chunks it received
  and sums them in fp32 (in rank order), then casts to the output's dtype.
- Exact fallback (``Transport``'s own collective): non-floating dtypes, collectives of fewer
  than ``min_numel`` values, inputs that are not contiguous, reduce ops other than SUM/AVG.

On CPU (``async_op=True``) the wire collective runs asynchronously and the returned work's
``wait()`` dequantizes; on accelerators (called on the core's communication stream with
``async_op=False``) everything is queued in stream order.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hyperfsdp_core.plugin import Transport, hookimpl, report_wire

from . import WIRE_BYTES, QCommPolicy, policy_of
from ._quant import dequantize_rows, packed_size, quantize_rows

HYPERFSDP_API = ">=1.1,<2"  # report_wire

_SUM = dist.ReduceOp.SUM
_AVG = dist.ReduceOp.AVG


def _gather(output, input, group, async_op):
    # looked up per call: torch 2.13 names it all_gather_single
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(output, input, group=group, async_op=async_op)


class _Pending:
    """The work a quantized collective returns on CPU: ``wait()`` waits for the wire
    collective, then runs the dequantization (once)."""

    __slots__ = ("_finish", "_work")

    def __init__(self, work, finish) -> None:
        self._work = work
        self._finish = finish

    def wait(self, timeout=None) -> bool:
        if self._work is not None:
            self._work.wait()
            self._work = None
            finish, self._finish = self._finish, None
            finish()
        return True


def _complete(work, finish):
    if work is None:  # ran in the call (accelerators: in stream order)
        finish()
        return None
    return _Pending(work, finish)


class QuantizedTransport(Transport):
    """Carries one unit's all-gathers and reduce-scatters as ``policy`` says."""

    def __init__(self, policy: QCommPolicy, unit_fqn: str) -> None:
        super().__init__()
        self.policy = policy
        self.unit_fqn = unit_fqn
        self._keys = {
            (kind, route): (unit_fqn, kind, route)
            for kind in ("all_gather", "reduce_scatter")
            for route in ("int8", "bf16", "exact")
        }

    def __repr__(self) -> str:
        return f"QuantizedTransport({self.policy!r}, unit={self.unit_fqn!r})"

    def _quantizes(self, mode, big: torch.Tensor, small: torch.Tensor) -> bool:
        return (
            mode is not None
            and big.dtype.is_floating_point
            and small.dtype == big.dtype
            and big.numel() >= max(self.policy.min_numel, 1)
            and small.numel() > 0
            and big.numel() % small.numel() == 0
            and big.is_contiguous()
            and small.is_contiguous()
        )

    # -- all-gather ------------------------------------------------------------------------
    def all_gather(self, output, input, group, async_op):
        mode = self.policy.all_gather
        if not self._quantizes(mode, output, input):
            WIRE_BYTES[self._keys["all_gather", "exact"]] += output.numel() * output.element_size()
            return super().all_gather(output, input, group, async_op)
        n = input.numel()
        world = output.numel() // n
        rows_out = output.view(world, n)
        if mode == "bf16":
            send = input.reshape(-1).to(torch.bfloat16)
            recv = torch.empty(world, n, dtype=torch.bfloat16, device=input.device)
            finish = lambda: rows_out.copy_(recv)  # noqa: E731
        else:
            block = self.policy.block
            send = quantize_rows(input.reshape(1, n), block).view(-1)
            recv = torch.empty(world, packed_size(n, block), dtype=torch.uint8, device=input.device)
            finish = lambda: rows_out.copy_(dequantize_rows(recv, n, block))  # noqa: E731
        WIRE_BYTES[self._keys["all_gather", mode]] += recv.numel() * recv.element_size()
        report_wire(recv)
        work = _gather(recv.view(-1), send, group, async_op)
        return _complete(work, finish)

    # -- reduce-scatter ----------------------------------------------------------------------
    def reduce_scatter(self, output, input, group, op, async_op, *, scratch_input=False):
        mode = self.policy.reduce_scatter
        kind = getattr(op, "op", op)  # a ReduceOp instance or its RedOpType
        if not self._quantizes(mode, input, output) or kind not in (_SUM, _AVG):
            WIRE_BYTES[self._keys["reduce_scatter", "exact"]] += (
                input.numel() * input.element_size()
            )
            return super().reduce_scatter(
                output, input, group, op, async_op, scratch_input=scratch_input
            )
        m = output.numel()
        world = input.numel() // m
        rows = input.view(world, m)
        if mode == "bf16":
            send = rows.to(torch.bfloat16)
            recv = torch.empty_like(send)

            def received():
                return recv.float()

        else:
            block = self.policy.block
            send = quantize_rows(rows, block)
            recv = torch.empty_like(send)

            def received():
                return dequantize_rows(recv, m, block)

        average = kind == _AVG

        def finish():
            total = received().sum(dim=0)  # fp32 accumulation, in rank order
            if average:
                total.div_(world)
            output.view(-1).copy_(total)

        WIRE_BYTES[self._keys["reduce_scatter", mode]] += send.numel() * send.element_size()
        report_wire(send)
        work = dist.all_to_all_single(recv, send, group=group, async_op=async_op)
        return _complete(work, finish)


class _FSDP2Comm:
    def __init__(self, policy: QCommPolicy, name: str) -> None:
        self.transport = QuantizedTransport(policy, name)

    def allocate(self, sizes, *, dtype, device):
        return torch.empty(*sizes, dtype=dtype, device=device)


class QuantizedAllGather(_FSDP2Comm):
    """The quantized all-gather as an FSDP2 comm object (``set_custom_all_gather``): it
    completes in the call (FSDP2 waits only for ``torch.distributed`` works)."""

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        work = self.transport.all_gather(output_tensor, input_tensor, group, async_op)
        if work is not None:
            work.wait()


class QuantizedReduceScatter(_FSDP2Comm):
    """The quantized reduce-scatter as an FSDP2 comm object (``set_custom_reduce_scatter``)."""

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        work = self.transport.reduce_scatter(output_tensor, input_tensor, group, op, async_op)
        if work is not None:
            work.wait()


@hookimpl(tryfirst=True)
def hyperfsdp_transport(unit):
    policy = policy_of(unit.modules)
    if policy is None or not policy.active:
        return None
    return QuantizedTransport(policy, unit.fqn)
