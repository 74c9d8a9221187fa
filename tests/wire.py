"""Bytes one collective puts on the loopback wire, for the multi-process meter tests."""
from admm_dist.bench.comm_wire import interface_tx_bytes


def wire_bytes(ctx, comm, vectors, brackets: int = 3) -> int:
    """Bytes ``comm.consensus_(vectors)`` sends over ``lo``, read on rank 0 between barriers
    (0 on the other ranks). A warm-up call first (gloo sets connections up lazily); then the
    smallest of ``brackets`` readings without the call is taken from the smallest with it:
    spurious loopback TCP retransmissions (two ranks sharing a core) only ever add bytes."""
    comm.consensus_(vectors)
    deltas = {False: [], True: []}
    for _ in range(brackets):
        for with_op in (False, True):
            comm.barrier()
            before = interface_tx_bytes("lo") if ctx.rank == 0 else 0
            comm.barrier()
            if with_op:
                comm.consensus_(vectors)
            comm.barrier()
            after = interface_tx_bytes("lo") if ctx.rank == 0 else 0
            comm.barrier()
            deltas[with_op].append(after - before)
    return min(deltas[True]) - min(deltas[False])
