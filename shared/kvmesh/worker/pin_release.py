"""Releasing a producer's pin after a pull, and, for a late pull, hearing that it was held.

A pin (a prefill's blocks held for the decode side, or a loan of cached blocks to a peer)
lives under an etcd lease and a local deadline. A pull that ended soon after the pin was
made releases it with a plain message. One that ended late asks instead, and waits for the
producer to say the pin was still held: if the lease ran out meanwhile, the producer may
have given those blocks to another request while they were read, and the bytes pulled must
not be used."""

from __future__ import annotations

from kvmesh.protocol import ReleaseReply, ReleaseRequest

# A pull that ends this many seconds after its pin was made confirms the release.
CONFIRM_RELEASE_AFTER = 1.0


async def release_confirmed(nc, subject: str, release: ReleaseRequest, timeout: float) -> tuple[bool, str]:
    """Release and wait for the producer's word: (True, "") when the pin was still held,
    else (False, why): it was gone, or the producer did not answer (then it may be gone)."""
    try:
        reply = await nc.request(subject, release.encode(), timeout=timeout)
        released = ReleaseReply.decode(reply.data).released
    except Exception as exc:  # noqa: BLE001 - no answer: the producer is gone, or says nothing usable
        return False, f"no confirmation of the pin: {exc!r}"
    return released, "" if released else "the pin was gone before the pull ended"
