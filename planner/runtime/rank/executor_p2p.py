"""The executor's point-to-point transfers: sends (non-blocking, released as they complete), receives
posted ahead of the compute that needs them, and the taint header each carries when verifying.

A boundary whose plan stage has an ``out_codec`` carries its tensors encoded (``planner.runtime.wire.codecs``),
both ways: the sender encodes, the receiver decodes and computes on the decoded tensor, and a verifier decodes
the same payload (or, as the sender, its own encoding) the same way, so it checks what the receiver uses."""
from __future__ import annotations

import torch

from planner.errors import InvalidInputError
from planner.instructions import Instruction
from planner.runtime.rank import audit_grads, audit_inputs, audit_signed
from planner.runtime.wire import codecs, comm
from planner.runtime.wire.comm import Kind, Pending

ACT_KINDS = {"F": (Kind.ACT, Kind.TAINT_ACT, Kind.VERDICT_ACT), "B": (Kind.GRAD, Kind.TAINT_GRAD, Kind.VERDICT_GRAD)}


class Transfers:
    """Sends and receives of boundary tensors.

    Mixed into :class:`~planner.runtime.rank.executor.Executor`, whose per-step state (``_reset``) it reads
    and writes.
    """

    def _boundary(self, ins: Instruction) -> int:
        """The boundary a transfer crosses: forward from stage k is boundary k, backward from k is k-1."""
        if ins.op in ("SEND_F", "RECV_B"):
            return ins.stage
        if ins.op in ("RECV_F", "SEND_B"):
            return ins.stage - 1
        assert ins.boundary is not None
        return ins.boundary

    def _tensors_for_send(self, ins: Instruction) -> list[torch.Tensor]:
        mb = ins.mb
        assert mb is not None
        if ins.op == "SEND_F":
            if mb not in self.saved:
                raise InvalidInputError(f"rank {self.rank}: {ins} before the forward of microbatch {mb}",
                                        fix="regenerate the plan")
            return [o.detach() for o in self.saved[mb][1]]
        if mb not in self.input_grads:
            raise InvalidInputError(f"rank {self.rank}: {ins} before the backward of microbatch {mb}",
                                    fix="regenerate the plan")
        return self.input_grads[mb]

    def _sent_tensors(self, d: str, mb: int) -> list[torch.Tensor]:
        """What this rank sends for (direction, mb): its output or input gradient, after any attack."""
        op = "SEND_F" if d == "F" else "SEND_B"
        assert self.stage is not None
        tensors = self._tensors_for_send(Instruction(op=op, stage=self.stage.index, mb=mb, peer=self.rank))
        if self.attacks is not None and self.attacks.active:
            tensors = self.attacks.apply(tensors, op_direction=d, step=self.step, mb=mb)
        return tensors

    def _codec(self, boundary: int) -> str:
        return self.plan.stages[boundary].out_codec

    def _encoded(self, d: str, boundary: int, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """The payload tensors ``tensors`` travel as across ``boundary`` in direction ``d``."""
        codec = self._codec(boundary)
        return [p for t in tensors for p in codecs.encode(t, codec, d)]

    def _decoded(self, d: str, boundary: int, payloads: list[torch.Tensor]) -> list[torch.Tensor]:
        """The tensors a receiver computes on, from the payloads posted with :meth:`_wire_specs`."""
        codec = self._codec(boundary)
        out, i = [], 0
        for shape, dtype in self._specs(d, boundary):
            k = len(codecs.payload_specs(shape, dtype, codec))
            out.append(codecs.decode(payloads[i:i + k], codec, shape, dtype, d))
            i += k
        return out

    def _delivered(self, d: str, mb: int) -> list[torch.Tensor]:
        """What the consumer of this rank's send for (d, mb) computes on: the sent tensors, encoded and decoded."""
        assert self.stage is not None
        boundary = self.stage.index if d == "F" else self.stage.index - 1
        tensors = self._sent_tensors(d, mb)
        if self._codec(boundary) == "none":
            return tensors
        return self._decoded(d, boundary, self._encoded(d, boundary, tensors))

    def _consumer(self, ins: Instruction) -> int:
        assert self.stage is not None and ins.mb is not None
        return self.plan.owner(self.stage.index + (1 if ins.direction == "F" else -1), ins.mb)

    def _send(self, ins: Instruction) -> None:
        d = ins.direction
        if not self.verifying and ins.peer != self._consumer(ins):
            return  # a copy for a verifier, and verification is off
        self._settle_sent(d, ins.mb)
        kind, header_kind, _ = ACT_KINDS[d]
        boundary = self._boundary(ins)
        tensors = self._encoded(d, boundary, self._sent_tensors(d, ins.mb))
        self.sent_bytes[d] += codecs.payload_bytes(tensors)
        header, dropped = None, False
        if self.verifying:
            dropped = ins.mb in (self.dropped_f if d == "F" else self.dropped_f | self.dropped_b)
            if self.attacks is not None and self.attacks.active:   # ``kind=taint``: a made-up drop
                dropped = dropped or self.attacks.taints(op_direction=d, step=self.step, mb=ins.mb)
            header = torch.tensor([int(dropped)], dtype=torch.int64, device=self.device)
            signature = audit_signed.signature(self, boundary, ins.mb, tensors) if d == "F" and \
                ins.peer == self._consumer(ins) else None
            if signature is not None:   # an audited consumer's input from an untrusted stage: signed
                header = torch.cat([header, signature.to(self.device)])
        if ins.peer == self._consumer(ins):   # an auditor of the stage it feeds may recompute from this copy
            if d == "F":
                audit_inputs.keep_input_copy(self, ins.mb)
            else:   # with the taint header it goes with
                audit_grads.keep_sent_grad(self, ins.mb, tainted=dropped)
        if not tensors and header is None:
            return
        with self._timed("comm"):
            self.sends.append(comm.send(tensors, peer=ins.peer, kind=kind, boundary=boundary, mb=ins.mb,
                                        header=header, header_kind=header_kind if header is not None else None,
                                        doing=f"sending {ins} (step {self.step})"))
            self._prune_sends()

    def _specs(self, d: str, boundary: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
        edge = self.edges[boundary]
        values = edge.act if d == "F" else edge.grad
        return [(v.shape, self.precision.wire_dtype(v.dtype)) for v in values]

    def _wire_specs(self, d: str, boundary: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """The payloads the tensors of :meth:`_specs` travel as under the boundary's codec."""
        codec = self._codec(boundary)
        return [p for shape, dtype in self._specs(d, boundary) for p in codecs.payload_specs(shape, dtype, codec)]

    def _post(self, d: str, *, peer: int, boundary: int, mb: int, doing: str, header_numel: int = 1) -> Pending | None:
        kind, header_kind, _ = ACT_KINDS[d]
        specs = self._wire_specs(d, boundary)
        if not specs and not self.verifying:
            return None
        return comm.recv(specs, peer=peer, kind=kind, boundary=boundary, mb=mb, device=self.device, doing=doing,
                         header_kind=header_kind if self.verifying else None, header_numel=header_numel)

    def _prefetch(self, i: int) -> None:
        """Before computing instruction ``i``, post the receives the *next* compute needs.

        The transfer then overlaps this compute instead of starting when the
        program reaches its RECV (gloo moves a message once both sides have
        posted). At most one compute's worth of extra buffers is alive.
        """
        for ins in self._next_recvs[i]:
            if (ins.direction, ins.mb) not in self.recvs and (ins.direction, ins.mb) not in self.received:
                self._post_recv(ins)

    def _post_recv(self, ins: Instruction) -> None:
        if (ins.direction, ins.mb) in self.recvs or (ins.direction, ins.mb) in self.received:
            return  # already posted by _prefetch
        with self._timed("comm"):
            boundary = self._boundary(ins)
            pending = self._post(ins.direction, peer=ins.peer, boundary=boundary, mb=ins.mb,
                                 doing=f"receiving {ins} (step {self.step})",
                                 header_numel=audit_signed.header_numel(self, ins.direction, boundary))
        if pending is not None:
            self.recvs[(ins.direction, ins.mb)] = pending

    def _wait(self, pending: Pending) -> list[torch.Tensor]:
        with self._timed("wait"):
            tensors = pending.wait()
        return tensors

    def _take(self, key: tuple[str, int]) -> list[torch.Tensor]:
        """The tensors received for (direction, mb), waiting for them if needed; the header is split off."""
        if key not in self.received:
            if key not in self.recvs:
                if not self._specs(key[0], self._edge_of(key[0])):
                    return []
                raise InvalidInputError(f"rank {self.rank}: microbatch {key[1]} used before it was received "
                                        f"({'activation' if key[0] == 'F' else 'gradient'})",
                                        fix="regenerate the plan (a RECV is missing or late)")
            tensors = self._wait(self.recvs.pop(key))
            if self.verifying:
                header, tensors = tensors[-1], tensors[:-1]
                self.taint_in[key] = bool(header[0].item())
                # a signed input: its signature checked and kept for the auditor; unsigned by its sender, dropped
                if key[0] == "F" and audit_signed.take(self, key[1], self._edge_of("F"), tensors, header):
                    self._drop("F", key[1])
                if self.taint_in[key]:
                    self._drop(key[0], key[1])
            self.received[key] = self._decoded(key[0], self._edge_of(key[0]), tensors)
            if key[0] == "B":   # an auditor of the next stage may compare it with its recompute
                audit_grads.keep_received_grad(self, key[1], self.received[key])
        return self.received[key]

    def _edge_of(self, d: str) -> int:
        assert self.stage is not None
        return self.stage.index - 1 if d == "F" else self.stage.index

    def _drop(self, d: str, mb: int) -> None:
        (self.dropped_f if d == "F" else self.dropped_b).add(mb)

    def _prune_sends(self) -> None:
        """Release the buffers of sends that have completed (their errors, if any, surface here)."""
        if len(self.sends) > 4:
            keep = []
            for p in self.sends:
                if p.completed():
                    p.wait()
                else:
                    keep.append(p)
            self.sends = keep

    def _finish_sends(self) -> None:
        with self._timed("wait"):
            for pending in self.sends:
                pending.wait()
            self.sends = []
