"""The disaggregated prefill/decode fields of the ExecuteModel step stream
(core/kv/connector.py), to protobuf and back: the KV sends and cancels a
step carries to the workers, and the sends the workers report finished or
failed. Stateless; proto/step_stream.py and proto/runner_output.py call it.
"""

from __future__ import annotations

from tokenbudget.core.kv.connector import KVConnectorMetadata, KVSend
from tokenbudget.core.outputs import ModelRunnerOutput
from tokenbudget.proto import worker_pb2
from tokenbudget.proto.convert import _i32, _i32_list


def kv_connector_metadata_to_proto(
    meta: KVConnectorMetadata, out: worker_pb2.KVConnectorMetadata
) -> None:
    out.SetInParent()  # present even when empty: the workers still report
    for send in meta.sends:
        if len(send.src_block_ids) != len(send.dst_block_ids):
            raise ValueError(
                f"KV send of {send.request_id!r}: {len(send.src_block_ids)} source blocks "
                f"but {len(send.dst_block_ids)} destination blocks"
            )
        out.sends.add(
            request_id=send.request_id,
            src_block_ids=_i32(send.src_block_ids),
            dst_block_ids=_i32(send.dst_block_ids),
            peer_handshakes=send.peer_handshakes,
        )
    out.cancels.extend(meta.cancels)


def kv_connector_metadata_from_proto(msg: worker_pb2.SchedulerOutput) -> KVConnectorMetadata | None:
    """The step's metadata, or None when ``msg`` carries none."""
    if not msg.HasField("kv_connector_metadata"):
        return None
    m = msg.kv_connector_metadata
    return KVConnectorMetadata(
        sends=[
            KVSend(
                s.request_id,
                _i32_list(s.src_block_ids),
                _i32_list(s.dst_block_ids),
                list(s.peer_handshakes),
            )
            for s in m.sends
        ],
        cancels=list(m.cancels),
    )


def kv_sending_to_proto(out: ModelRunnerOutput, msg: worker_pb2.ModelRunnerOutput) -> None:
    if out.finished_sending:
        msg.finished_sending.extend(sorted(out.finished_sending))
    if out.failed_sending:
        msg.failed_sending.update(out.failed_sending)


def kv_sending_from_proto(
    msg: worker_pb2.ModelRunnerOutput,
) -> tuple[set[str] | None, dict[str, str] | None]:
    """(finished_sending, failed_sending); None for an empty one."""
    return (
        set(msg.finished_sending) if msg.finished_sending else None,
        dict(msg.failed_sending) if msg.failed_sending else None,
    )


class KVSendTally:
    """The sends of several workers (tensor-parallel ranks, each writing its
    own share of the KV) as one engine sees them: a send is done once every
    worker reported it, finished or failed (before that one may still write
    into the peer's blocks); it failed if any worker failed it, with the
    first reason. Workers may report a send in different steps."""

    def __init__(self, num_workers: int) -> None:
        self.num_workers = num_workers
        self._reports: dict[str, int] = {}  # request id -> workers that reported it
        self._why: dict[str, str] = {}  # request id -> the first failure

    def merge(
        self, outputs: list[tuple[set[str] | None, dict[str, str] | None]]
    ) -> tuple[set[str] | None, dict[str, str] | None]:
        """One step's (finished_sending, failed_sending) of every worker -> the
        sends done this step, as (finished, failed), None when empty."""
        done: list[str] = []
        for finished, failed in outputs:
            for rid, why in (failed or {}).items():
                self._why.setdefault(rid, why)
            for rid in (*(finished or ()), *(failed or ())):
                count = self._reports.get(rid, 0) + 1
                self._reports[rid] = count
                if count == self.num_workers:
                    done.append(rid)
        out_finished: set[str] = set()
        out_failed: dict[str, str] = {}
        for rid in done:
            del self._reports[rid]
            why = self._why.pop(rid, None)
            if why is None:
                out_finished.add(rid)
            else:
                out_failed[rid] = why
        return out_finished or None, out_failed or None
