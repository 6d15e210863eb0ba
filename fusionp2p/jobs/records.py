"""Which of two copies of a job's DHT record is newer (``Transport.rank_records``).

The DHT keeps one value per key and a get returns the first answer it hears; with several writers
over time (a job's leaders, epoch after epoch) a stale copy on one peer could hide the newest record.
Every node and client registers these rankers: a put never replaces a better value, and a get picks
the best of the answers. A value that does not verify ranks below every valid one.
"""

from __future__ import annotations

from fusionp2p.errors import RemoteProtocolError
from fusionp2p.jobs.election import PLAN_PREFIX, rank_plan_record
from fusionp2p.jobs.spec import decode_signed
from fusionp2p.net.identity import verify
from fusionp2p.net.transport import Transport
from fusionp2p.wire.jobrecords import JobIndex, JobStatus, decode_record


def rank_job_record(value: bytes) -> tuple[int | float, ...] | None:
    """Status records: terminal, then epoch, step and the signer's clock; a spec envelope ranks (0,)."""
    try:
        rec = decode_record(value, verify)
    except RemoteProtocolError:
        try:
            decode_signed(value)
        except RemoteProtocolError:
            return None
        return (0,)
    if isinstance(rec, JobStatus):
        return (*rec.order(), rec.at)
    return None


def rank_index(value: bytes) -> tuple[int | float, ...] | None:
    try:
        rec = decode_record(value, verify)
    except RemoteProtocolError:
        return None
    if not isinstance(rec, JobIndex):
        return None
    return (max((c for _, _, c in rec.jobs), default=0.0), len(rec.jobs))


def rank_plan(value: bytes) -> tuple[int | float, ...] | None:
    """Plan records (per epoch and the job's latest): ``jobs/election.py:rank_plan_record``."""
    return rank_plan_record(value)


def register_rankers(transport: Transport) -> None:
    """Rank the job records on *transport* (call once per transport; later calls replace the rankers)."""
    transport.rank_records("/fusionp2p/job/", rank_job_record)
    transport.rank_records("/fusionp2p/publisher/", rank_index)
    transport.rank_records(PLAN_PREFIX, rank_plan)


__all__ = ["rank_index", "rank_job_record", "rank_plan", "register_rankers"]
