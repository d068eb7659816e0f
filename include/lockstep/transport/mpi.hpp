// lockstep/transport/mpi.hpp: ranks as MPI processes (OpenMPI), talking point to point.
//
//   lockstep::transport::mpi_session session(&argc, &argv);         // MPI_Init_thread .. MPI_Finalize
//   lockstep::group g(lockstep::transport::mpi(MPI_COMM_WORLD));      // duplicates the communicator
//
// mpi is the routed transport (routed.hpp): plain MPI (mpi_p2p.hpp, which states how receives are
// matched, how waits back off, and the limits) for peers on other nodes, and a shared-memory
// segment (shm/endpoint.hpp: a send is complete once copied into the peer's ring, a receive
// sleeps on a futex the sender rings, and consume reads a received message in the ring, so a
// reduce step adds from it directly) for the peers of its own node. Set up by the constructor and
// by split(), collectively; off with mpi_options or LOCKSTEP_MPI_SHM=0, and off by itself
// (shared_memory_note() says why) where the segment cannot be made. Sends by reference (the
// receiver copies out of the sender's memory, process_vm_readv) are off by default and on with
// mpi_options or LOCKSTEP_MPI_CMA=1 (routed.hpp says why). What the path gains over MPI's own is
// in docs/benchmarks.md, "Shared memory between the ranks of a node".
//
// Over TCP (btl tcp), Open MPI sends a message above btl_tcp_eager_limit (64 KiB) by rendezvous:
// the bulk waits for the receiver's acknowledgement, a round trip per message that, when two
// ranks exchange (a 2-rank ring, the rows and columns of a 2 x C torus), shares the connection
// with the receiver's own data. Raise the limit above one segment (--mca btl_tcp_eager_limit
// 1100000 --mca btl_tcp_rndv_eager_limit 1100000 --mca btl_tcp_max_send_size 1100000 for the
// default 1 MiB segment; docs/scaling.md, "Rendezvous", has what it gains). It is the job's
// setting to make, not the library's.
//
// abort() marks this endpoint failed: later calls on it throw errc::aborted at once, and so do the
// waits of every other rank of the group, on any node: an abort message on a communicator of its
// own that every wait probes (mpi_p2p.hpp, which also states the limits of a send MPI cannot
// withdraw), and through the segment for the ranks of its node. A wait for a peer on this node
// also watches that peer's process (peer_watch.hpp; shared memory on or off): one that was killed
// or exited is reported within milliseconds, naming it, and the group is told in its name. Across
// nodes a dead process is found by the group's timeout. A timeout names what this node can see of
// the peer (stopped, running, gone). The groups split from one endpoint fail together: a failure
// in any of them reaches the waits of all of them (mpi_p2p.hpp). without_failed() builds a group
// of the survivors.
// docs/reliability.md has the promises and the measured times.
#pragma once

#include "routed.hpp"

namespace lockstep::transport {

using mpi = routed;

}  // namespace lockstep::transport
